"""Closed-loop load: keep N requests in flight, record each one's latency (demo and bench)."""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LoadResult", "run_closed_loop", "percentile"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[rank]


@dataclass
class LoadResult:
    """Latencies (ms), failures and batch sizes of one load run."""

    name: str
    latencies_ms: list[float] = field(default_factory=list)
    failures: int = 0
    elapsed_s: float = 0.0
    batch_sizes: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def requests(self) -> int:
        return len(self.latencies_ms) + self.failures

    @property
    def throughput(self) -> float:
        return len(self.latencies_ms) / self.elapsed_s if self.elapsed_s else 0.0

    def row(self) -> dict[str, Any]:
        """The figures a report table shows."""
        return {"name": self.name, "requests": self.requests, "failures": self.failures,
                "p50_ms": percentile(self.latencies_ms, 50), "p99_ms": percentile(self.latencies_ms, 99),
                "throughput_rps": self.throughput}


def run_closed_loop(name: str, submit: Callable[[int], Future[Any]], total: int, in_flight: int,
                    on_done: Callable[[], None] | None = None) -> LoadResult:
    """Send ``total`` requests with ``submit(i)``, at most ``in_flight`` outstanding at once."""
    result = LoadResult(name)
    slots = threading.Semaphore(in_flight)
    lock = threading.Lock()
    all_done = threading.Event()
    finished = 0

    def done(started: float, future: Future[Any]) -> None:
        nonlocal finished
        latency_ms = (time.perf_counter() - started) * 1000.0
        with lock:
            exc = future.exception()
            if exc is None:
                result.latencies_ms.append(latency_ms)
                size = getattr(future.result(), "parameters", {}).get("batch_size")
                if size is not None:
                    result.batch_sizes[int(size)] += 1
            else:
                result.failures += 1
                result.errors[type(exc).__name__] += 1
            finished += 1
            if finished == total:
                all_done.set()
        slots.release()
        if on_done is not None:
            on_done()

    began = time.perf_counter()
    for i in range(total):
        slots.acquire()
        started = time.perf_counter()
        future = submit(i)
        future.add_done_callback(functools.partial(done, started))
    if total:
        all_done.wait()
    result.elapsed_s = time.perf_counter() - began
    return result
