"""For the bench scripts: one embedded ``redis-server`` and one CPU worker in a folder of their own,
and the peak of Redis' memory while something runs. Each process is stopped by its PID."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from asyncinfer.ops.redis_server import RedisServer
from tests.support.processes import start_worker

__all__ = ["MemoryPeak", "local_fleet"]


@contextmanager
def local_fleet(models: str, hostname: str, **env: str) -> Iterator[tuple[str, Path]]:
    """A Redis and a worker of ``models`` (its environment plus ``env``); yields the Redis URL and
    the folder (removed after)."""
    work = Path(tempfile.mkdtemp(prefix="asyncinfer-bench-"))
    server = RedisServer(work / "redis", appendonly=False).start()
    try:
        worker = start_worker(server.url, work / "worker.log", "--device", "cpu", "--models",
                              models, "--hostname", hostname, **env)
        try:
            yield server.url, work
        finally:
            worker.stop()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


class MemoryPeak:
    """Redis' ``used_memory`` before, at its peak while the ``with`` block runs (read every
    ``every_s``), and after."""

    def __init__(self, redis: Any, every_s: float = 0.02) -> None:
        self.redis, self.every_s = redis, every_s
        self.before = self.peak = self.after = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _used(self) -> int:
        return int(self.redis.info("memory")["used_memory"])

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._used())
            self._stop.wait(self.every_s)

    def __enter__(self) -> MemoryPeak:
        self.before = self.peak = self._used()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.after = self._used()
