"""An S3 server for the tests: moto's server mode (``python -m moto.server``), an emulator of the
S3 protocol that installs from the package index (there is no real S3 here). Started on a free
port, stopped by its PID."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from asyncinfer.ops.benchmark.host import free_port
from asyncinfer.supervision.processes import stop_process

__all__ = ["s3_server"]


@contextmanager
def s3_server(bucket: str) -> Iterator[dict[str, Any]]:
    """A running S3 emulator with ``bucket`` made; yields fsspec's options for it (its endpoint
    and the emulator's test credentials)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"moto's S3 server did not listen on {port}") from None
                time.sleep(0.1)
        options = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing",
                   "secret": "testing"}
        import s3fs

        s3fs.S3FileSystem(**options).mkdir(bucket)
        yield options
    finally:
        stop_process(proc, __import__("signal").SIGTERM, 10)
