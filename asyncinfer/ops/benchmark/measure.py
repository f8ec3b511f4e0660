"""Load shapes for the bench: closed loop for a duration, open loop at a fixed rate, the limit."""

from __future__ import annotations

import functools
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncinfer.engine.threads import cpu_cores, intra_op_threads
from asyncinfer.models.base import Model
from asyncinfer.ops.benchmark.loadgen import percentile
from asyncinfer.wire.protocol import decode_request

__all__ = ["Run", "closed_loop", "open_loop", "model_limit", "direct_call_ms"]

Submit = Callable[[int], "Future[Any]"]


@dataclass
class Run:
    """The outcome of one load run."""

    system: str
    workload: str
    mode: str  # "closed" or "open"
    level: float  # requests in flight (closed) or offered rate in req/s (open)
    latencies_ms: list[float] = field(default_factory=list)
    failures: int = 0
    elapsed_s: float = 0.0
    rows: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)
    worker_cpu_ms_per_request: float | None = None
    #: The bench's own process (the client: publishing, result delivery) and Redis.
    client_cpu_ms_per_request: float | None = None
    redis_cpu_ms_per_request: float | None = None
    #: ``asyncinfer gateway`` (the ``gateway`` systems only).
    gateway_cpu_ms_per_request: float | None = None

    @property
    def throughput(self) -> float:
        """Completed requests per second."""
        return len(self.latencies_ms) / self.elapsed_s if self.elapsed_s else 0.0

    def summary(self) -> dict[str, Any]:
        lat = self.latencies_ms
        return {
            "system": self.system, "workload": self.workload, "mode": self.mode, "level": self.level,
            "requests": len(lat) + self.failures, "failures": self.failures,
            "throughput_rps": round(self.throughput, 2),
            "p50_ms": round(percentile(lat, 50), 3), "p95_ms": round(percentile(lat, 95), 3),
            "p99_ms": round(percentile(lat, 99), 3),
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "worker_cpu_ms_per_request": _ms(self.worker_cpu_ms_per_request),
            "client_cpu_ms_per_request": _ms(self.client_cpu_ms_per_request),
            "redis_cpu_ms_per_request": _ms(self.redis_cpu_ms_per_request),
            "gateway_cpu_ms_per_request": _ms(self.gateway_cpu_ms_per_request),
        }


class _Recorder:
    def __init__(self, run: Run) -> None:
        self.run = run
        self.lock = threading.Lock()
        self.outstanding = 0
        self.idle = threading.Condition(self.lock)

    def sent(self) -> None:
        with self.lock:
            self.outstanding += 1

    def done(self, started: float, future: Future[Any]) -> None:
        latency_ms = (time.perf_counter() - started) * 1000.0
        with self.lock:
            if future.exception() is None:
                self.run.latencies_ms.append(latency_ms)
                params = getattr(future.result(), "parameters", None) or {}
                if "batch_size" in params:
                    self.run.batch_sizes[int(params["batch_size"])] += 1
            else:
                self.run.failures += 1
            self.outstanding -= 1
            self.idle.notify_all()

    def wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while self.outstanding and time.monotonic() < deadline:
                self.idle.wait(max(0.0, deadline - time.monotonic()))


def closed_loop(run: Run, submit: Submit, in_flight: int, duration_s: float) -> Run:
    """Keep ``in_flight`` requests outstanding for ``duration_s``; count what completes."""
    rec = _Recorder(run)
    slots = threading.Semaphore(in_flight)

    def finished(started: float, future: Future[Any]) -> None:
        rec.done(started, future)
        slots.release()

    began = time.perf_counter()
    i = 0
    while time.perf_counter() - began < duration_s:
        if not slots.acquire(timeout=0.5):
            continue
        started = time.perf_counter()
        rec.sent()
        submit(i).add_done_callback(functools.partial(finished, started))
        i += 1
    rec.wait_idle(60.0)
    run.elapsed_s = time.perf_counter() - began
    return run


def open_loop(run: Run, submit: Submit, rate_rps: float, duration_s: float) -> Run:
    """Send at ``rate_rps`` for ``duration_s`` whatever the latency (no coordinated omission:
    latency counts from each request's scheduled send time)."""
    rec = _Recorder(run)
    interval_s = 1.0 / rate_rps
    began = time.perf_counter()
    i = 0
    while True:
        scheduled = began + i * interval_s
        if scheduled - began >= duration_s:
            break
        delay = scheduled - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        rec.sent()
        submit(i).add_done_callback(functools.partial(rec.done, scheduled))
        i += 1
    rec.wait_idle(60.0)
    run.elapsed_s = time.perf_counter() - began
    return run


def _batch_of(model: Model, payloads: list[dict[str, Any]], rows: int, first: int) -> dict[str, Any]:
    """A batch of ``rows`` requests, ``payloads[first]`` onwards (cycling), as a worker forms it."""
    requests = [decode_request("limit", {"model": model.name,
                                         "inputs": payloads[i % len(payloads)]["inputs"]})
                for i in range(first, first + rows)]
    names = [t.name for t in requests[0].inputs]
    values = {name: [next(t.value for t in r.inputs if t.name == name) for r in requests]
              for name in names}
    return {name: model.collate(name, vals) for name, vals in values.items()}


def _rate(model: Model, batches: list[dict[str, Any]], rows: int, callers: int,
          duration_s: float) -> float:
    """Rows/s of ``callers`` threads calling the three stages on ``batches`` in turn, over whole
    passes of ``batches``: at least ``duration_s``, then to the end of the pass. Batches of rows
    of unlike cost (short and long sentences) cost unlike times, so a run cut off mid-pass would
    be the rate of whichever batches it happened to reach."""
    taken = 0
    lock = threading.Lock()
    began = time.perf_counter()

    def next_batch() -> dict[str, Any] | None:
        nonlocal taken
        with lock:
            if taken % len(batches) == 0 and taken and time.perf_counter() - began >= duration_s:
                return None
            taken += 1
            return batches[(taken - 1) % len(batches)]

    def call() -> None:
        with torch.inference_mode():
            while (batch := next_batch()) is not None:
                model.postprocess(model.forward(model.preprocess(batch)))

    threads = [threading.Thread(target=call, daemon=True) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return taken * rows / (time.perf_counter() - began)


def model_limit(model: Model, payloads: dict[str, Any] | list[dict[str, Any]],
                batch_sizes: tuple[int, ...], duration_s: float,
                by_cost: bool = False) -> dict[int, float]:
    """Rows/s of the model called in-process (preprocess, forward, postprocess) per batch size,
    for the sizes the model's ``max_batch_size`` allows (and that size itself): a worker never
    runs a larger batch, so a larger one is no limit of it.

    Batches are made of ``payloads`` in turn, as the load sends them (``by_cost``: sorted by
    the cost of a row first). Each size is the better of
    two arrangements: one caller with torch's threads, and (for a model of several
    ``instances``) that many callers at once with the worker's share of threads each
    (:mod:`asyncinfer.engine.threads`), so the limit is never below what the worker's own
    arrangement could do in-process.
    """
    payloads = payloads if isinstance(payloads, list) else [payloads]
    model.load(torch.device("cpu"))
    if by_cost:  # batches of like cost (Model.row_cost): what length-aware batching can reach
        payloads = sorted(payloads, key=lambda p: model.row_cost(decode_request(
            "cost", {"model": model.name, "inputs": p["inputs"]})) or 0.0)
    largest = model.options.max_batch_size if model.batchable else 1
    sizes = sorted({s for s in batch_sizes if s <= largest} | {largest})
    instances = model.options.instances
    shared = intra_op_threads(0, instances, on_cpu=True, cores=cpu_cores(), omp_num_threads=None)
    default_threads = torch.get_num_threads()
    rates = {}
    for size in sizes:
        # every payload once a pass (the rate is of whole passes); batches of like cost in a
        # shuffled order, as they would come to a worker
        count = max(8, -(-len(payloads) // size))
        batches = [_batch_of(model, payloads, size, k * size) for k in range(count)]
        if by_cost:
            random.Random(size).shuffle(batches)
        with torch.inference_mode():
            model.postprocess(model.forward(model.preprocess(batches[0])))  # warm up
        rates[size] = _rate(model, batches, size, 1, duration_s)
        if instances > 1:
            torch.set_num_threads(shared or default_threads)
            try:
                rates[size] = max(rates[size], _rate(model, batches, size, instances, duration_s))
            finally:
                torch.set_num_threads(default_threads)
    return rates


def direct_call_ms(model: Model, payload: dict[str, Any], calls: int = 200) -> float:
    """Median time of one in-process call for one request: decode, three stages."""
    model.load(torch.device("cpu"))
    times = []
    with torch.inference_mode():
        for _ in range(calls):
            began = time.perf_counter()
            batch = _batch_of(model, [payload], 1, 0)
            model.postprocess(model.forward(model.preprocess(batch)))
            times.append((time.perf_counter() - began) * 1000.0)
    return percentile(times, 50)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
