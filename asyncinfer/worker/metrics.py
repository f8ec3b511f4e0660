"""Prometheus metrics of a device worker, named after Triton's ``nv_inference_*``.

Always recorded (a few lock-protected additions per batch and per request, on children labelled
once and cached); served over HTTP only when the worker runs with ``--metrics-port N``
(``ASYNCINFER_METRICS_PORT``). The rest of the worker calls the small functions here:
:func:`record_batch` once per device batch, :func:`record_outcome` once per finished request,
:func:`count_retry` once per retry. Gauges (pending, in flight) are read when scraped, from the
sources the worker registers with :func:`watch`.

The same counts feed :func:`throughput_per_s`, the recent requests per second that
``asyncinfer status`` shows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import disable_created_metrics
from prometheus_client.registry import Collector

__all__ = ["record_batch", "record_outcome", "count_retry", "watch", "serve",
           "throughput_per_s", "in_flight_now", "THROUGHPUT_WINDOW_S"]

log = logging.getLogger(__name__)

disable_created_metrics()  # the *_created series only double what a scrape has to parse

#: Seconds over which :func:`throughput_per_s` averages.
THROUGHPUT_WINDOW_S = 10

_DURATION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                       5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

_SUCCESS = Counter("asyncinfer_inference_request_success",
                   "Requests answered with a result.", ["model", "device"])
_FAILURE = Counter("asyncinfer_inference_request_failure",
                   "Requests answered with a FAILURE; reason is the exception class.",
                   ["model", "device", "reason"])
_REVOKED = Counter("asyncinfer_inference_request_revoked",
                   "Requests revoked or expired before they ran.", ["model", "device"])
_RETRIES = Counter("asyncinfer_inference_retries", "Requests sent back for another try.",
                   ["model", "device"])
_QUEUE = Histogram("asyncinfer_inference_queue_duration_seconds",
                   "Per request: taken from the queue by the worker → its batch starts.",
                   ["model", "device"], buckets=_DURATION_BUCKETS_S)
_COMPUTE = Histogram("asyncinfer_inference_compute_duration_seconds",
                     "Per device batch: batch start → results on the host (prepare, forward, copy).",
                     ["model", "device"], buckets=_DURATION_BUCKETS_S)
_BATCH = Histogram("asyncinfer_inference_batch_size", "Rows per device batch.",
                   ["model", "device"], buckets=_BATCH_BUCKETS)


class _Children:
    """The labelled children of one (model, device), looked up once."""

    __slots__ = ("success", "revoked", "retries", "queue", "compute", "batch", "failures", "labels")

    def __init__(self, model: str, device: str) -> None:
        self.labels = (model, device)
        self.success = _SUCCESS.labels(model, device)
        self.revoked = _REVOKED.labels(model, device)
        self.retries = _RETRIES.labels(model, device)
        self.queue = _QUEUE.labels(model, device)
        self.compute = _COMPUTE.labels(model, device)
        self.batch = _BATCH.labels(model, device)
        self.failures: dict[str, Any] = {}

    def failure(self, reason: str) -> Any:
        child = self.failures.get(reason)
        if child is None:
            child = self.failures[reason] = _FAILURE.labels(*self.labels, reason)
        return child


_children: dict[tuple[str, str], _Children] = {}
_children_lock = threading.Lock()


def _of(model: str, device: str) -> _Children:
    found = _children.get((model, device))
    if found is None:
        with _children_lock:
            found = _children.get((model, device))
            if found is None:
                found = _children[(model, device)] = _Children(model, device)
    return found


class _Ring:
    """Finished requests per second over the last :data:`THROUGHPUT_WINDOW_S` seconds."""

    def __init__(self, window_s: int) -> None:
        self.window_s = window_s
        self._seconds = [0] * window_s
        self._counts = [0] * window_s
        self._lock = threading.Lock()

    def add(self, n: int, now: float | None = None) -> None:
        second = int(time.monotonic() if now is None else now)
        i = second % self.window_s
        with self._lock:
            if self._seconds[i] != second:
                self._seconds[i], self._counts[i] = second, 0
            self._counts[i] += n

    def rate(self, now: float | None = None) -> float:
        """Requests per second over the window: the last full seconds and the current part one."""
        now = time.monotonic() if now is None else now
        second = int(now)
        with self._lock:
            total = sum(c for s, c in zip(self._seconds, self._counts, strict=True)
                        if second - self.window_s < s <= second)
        return total / (self.window_s - 1 + (now - second))


_finished = _Ring(THROUGHPUT_WINDOW_S)


def record_batch(model: str, device: str, rows: int, compute_s: float,
                 queue_waits_s: Iterable[float] = ()) -> None:
    """One device batch of ``rows`` rows took ``compute_s``; its requests waited ``queue_waits_s``."""
    children = _of(model, device)
    children.batch.observe(rows)
    children.compute.observe(compute_s)
    observe = children.queue.observe
    for wait_s in queue_waits_s:
        observe(wait_s)


def record_outcome(model: str, device: str, state: str, exc: BaseException | None = None) -> None:
    """One request ended in ``state`` (Celery's ``SUCCESS``, ``FAILURE``, ``REVOKED``)."""
    children = _of(model, device)
    if state == "SUCCESS":
        children.success.inc()
    elif state == "REVOKED":
        children.revoked.inc()
    else:
        children.failure(type(exc).__name__ if exc is not None else state).inc()
    _finished.add(1)


def count_retry(model: str, device: str) -> None:
    """One request of ``model`` on ``device`` goes back for another try."""
    _of(model, device).retries.inc()


def throughput_per_s() -> float:
    """Requests this process finished per second, over the last ~10 s."""
    return _finished.rate()


# -- gauges read at scrape time ----------------------------------------------------------------

_sources: dict[str, Any] = {"device": "", "pending": None, "in_flight": None}


def watch(*, device: str | None = None, pending: Callable[[], dict[str, int]] | None = None,
          in_flight: Callable[[], int] | None = None) -> None:
    """Register where the gauges come from: ``pending()`` per model, ``in_flight()``."""
    if device is not None:
        _sources["device"] = device
    if pending is not None:
        _sources["pending"] = pending
    if in_flight is not None:
        _sources["in_flight"] = in_flight


def in_flight_now() -> int:
    """Requests taken by the worker and not yet answered (0 when nothing is registered)."""
    source = _sources["in_flight"]
    return int(source()) if source is not None else 0


class _GaugeCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        device = _sources["device"]
        pending = GaugeMetricFamily("asyncinfer_inference_pending_requests",
                                    "Requests waiting in the batcher for the device.",
                                    labels=["model", "device"])
        source = _sources["pending"]
        for model, n in sorted((source() if source is not None else {}).items()):
            pending.add_metric([model, device], n)
        yield pending
        in_flight = GaugeMetricFamily("asyncinfer_inference_in_flight_requests",
                                      "Requests taken from the queues and not yet answered.",
                                      labels=["device"])
        in_flight.add_metric([device], in_flight_now())
        yield in_flight


REGISTRY.register(_GaugeCollector())

_server: Any = None


def serve(port: int, addr: str = "0.0.0.0") -> bool:
    """Serve ``/metrics`` on ``port`` from this process (once); False if the port is taken."""
    global _server
    if _server is not None:
        return True
    try:
        _server = start_http_server(port, addr)
    except OSError as exc:
        log.warning("metrics: cannot serve on port %d (%s); not serving metrics", port, exc)
        return False
    log.info("metrics on http://%s:%d/metrics", addr, port)
    return True
