"""Redis refuses writes while workers serve, then takes them again: the same worker processes ride
it out and serve again, nothing accepted is lost, and every submit in between is answered or
refused with an error naming Redis' reason.

Out of memory (``maxmemory`` under ``noeviction``) is in tests/faults/test_delivery.py, on both
consumers.

Redis' disk is a small tmpfs under its append-only file; a client streams 64 KB requests until the
disk is full (Redis answers ``MISCONF Errors writing to the AOF file: No space left on device``),
then the tmpfs grows (space returns). Once on each consumer: the fast one (whose device worker also
runs Celery's consumer on its control queue, mingle and gossip) and Celery's stock consumer
(``ASYNCINFER_CONSUMER=celery``, on the project's kombu transport).
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from asyncinfer.client import Client
from asyncinfer.client.responses import InferFuture
from asyncinfer.ops.redis_server import RedisServer
from tests.support.processes import launch_worker, start_worker
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(300)

#: Floats in a request (64 KiB of FP32).
ROW = 16384


@contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on ``path`` for the block (root only: skipped otherwise)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _grow(path: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


class _Stream:
    """Submits one 64 KB identity request every ``every_s`` from a thread of its own, keeping
    what each submit gave: a future (accepted) or an exception (refused)."""

    def __init__(self, client: Client, every_s: float = 0.05) -> None:
        self.client = client
        self.every_s = every_s
        self.accepted: list[tuple[int, float, InferFuture]] = []
        self.refused: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream", daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            x = np.full((1, ROW), float(i), np.float32)
            try:
                future = self.client.submit("identity", {"x": x})
                future.sent()  # on the queue, or the refusal raised
                self.accepted.append((i, time.monotonic(), future))
            except Exception as exc:  # noqa: BLE001 - counted, and its message checked
                self.refused.append(exc)
            i += 1
            self._stop.wait(self.every_s)

    @property
    def sent(self) -> int:
        return len(self.accepted) + len(self.refused)

    def start(self) -> _Stream:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


@pytest.mark.parametrize("consumer", ["fast", "celery"])
def test_a_full_disk_under_redis_is_ridden_out_and_nothing_accepted_is_lost(
        consumer: str, tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "disk", "3m") as disk:
        # Given Redis keeping its append-only file on a small disk, and a worker serving
        server = RedisServer(disk, appendonly=True).start()
        worker = second = None
        client = Client(broker_url=server.url, serializer="msgpack")
        stream = _Stream(client)
        try:
            worker = start_worker(server.url, tmp_path / "worker.log", "--device", "cpu",
                                  "--models", "identity", "--hostname", f"full-{consumer}@%h",
                                  ASYNCINFER_CONSUMER=consumer)
            pid = worker.pid
            # When a client streams requests until the disk is full, and on for a while
            stream.start()
            wait_for(lambda: stream.refused, 120, "Redis refusing a submit (its disk full)")
            # and a second worker starts while the disk is full (its start-up, mingle, ...)
            second = launch_worker(server.url, tmp_path / "second.log", "--device", "cpu",
                                   "--models", "identity", "--hostname", f"late-{consumer}@%h",
                                   ASYNCINFER_CONSUMER=consumer)
            wait_for(lambda: "MISCONF" in second.log(), 60, "the second worker meeting the refusal")
            refused_from = len(stream.refused)
            wait_for(lambda: len(stream.refused) >= refused_from + 60, 60,
                     "60 more submits refused")
            # Then each refusal names Redis' reason in its own words
            for exc in stream.refused:
                assert "broker cannot write to its disk (MISCONF" in str(exc), repr(exc)
            # When space returns
            _grow(disk, "512m")
            grown_at = time.monotonic()
            # Then the same worker serves again: a request sent after space returned is answered
            wait_for(lambda: [f for _, t, f in stream.accepted if t > grown_at and f.done()
                              and f.exception() is None], 120, "a request answered after space returned")
            served_again_s = time.monotonic() - grown_at
            wait_for(lambda: len([1 for _, t, _ in stream.accepted if t > grown_at]) >= 40, 60,
                     "40 requests accepted after space returned")
            stream.stop()
            # And every request accepted, before, during or after, is answered with its own data
            lost = []
            for i, _, future in stream.accepted:
                try:
                    out = future.result(timeout=60)["x"]
                    assert out.shape == (1, ROW) and out[0, 0] == float(i)
                except Exception as exc:  # noqa: BLE001 - counted below
                    lost.append((i, repr(exc)))
            print(f"full disk ({consumer} consumer): sent {stream.sent}, accepted "
                  f"{len(stream.accepted)}, refused {len(stream.refused)}, answered "
                  f"{len(stream.accepted) - len(lost)}, lost {len(lost)}; serving again "
                  f"{served_again_s:.1f} s after space returned")
            assert lost == []
            # by the same process, which never met an unrecoverable error; and the worker that
            # started on a full disk is up and serving, the same process too
            assert worker.process.poll() is None and worker.pid == pid
            log = worker.log()
            assert "Unrecoverable error" not in log
            assert "MISCONF" in log  # it met the refusal, and said so
            second.wait_ready(120)
            worker.stop()  # the second one alone serves these
            answered = client.map("identity", [{"x": np.full((1, 4), float(i), np.float32)}
                                               for i in range(20)], timeout_s=60)
            assert [a["x"][0, 0] for a in answered] == [float(i) for i in range(20)]
            assert second.process.poll() is None
            assert "Unrecoverable error" not in second.log()
        finally:
            stream.stop()
            client.close()
            for proc in (worker, second):
                if proc is not None:
                    proc.stop()
            server.stop()
