"""Prometheus metrics of a device worker, named after Triton's ``nv_inference_*``.

Always recorded (a few lock-protected additions per batch and per request, on children labelled
once and cached); served over HTTP only when the worker runs with ``--metrics-port N``
(``ASYNCINFER_METRICS_PORT``). Each :class:`WorkerMetrics` has a registry of its own (the
process's and Python's collectors included), so two workers in one process count apart. The
worker calls :meth:`~WorkerMetrics.record_batch` once per device batch,
:meth:`~WorkerMetrics.record_outcome` once per finished request and
:meth:`~WorkerMetrics.count_retry` once per retry. Gauges (pending, in flight) are read when
scraped, from the sources the worker registers with :meth:`~WorkerMetrics.watch`.

The same counts feed :meth:`~WorkerMetrics.throughput_per_s`, the recent requests per second that
``asyncinfer status`` shows, and :attr:`~WorkerMetrics.stats`, the worker's share of the fleet
statistics (worker/stats.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import disable_created_metrics
from prometheus_client.registry import Collector

from asyncinfer.metrics_registry import process_registry
from asyncinfer.worker.stats import StatsCounts

__all__ = ["WorkerMetrics", "THROUGHPUT_WINDOW_S"]

log = logging.getLogger(__name__)

disable_created_metrics()  # the *_created series only double what a scrape has to parse

#: Seconds over which :meth:`WorkerMetrics.throughput_per_s` averages.
THROUGHPUT_WINDOW_S = 10

_DURATION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                       5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class _Families:
    """The worker's metric families, on its registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model", "device"]
        self.success = Counter("asyncinfer_inference_request_success",
                               "Requests answered with a result.", labels, registry=registry)
        self.failure = Counter("asyncinfer_inference_request_failure",
                               "Requests answered with a FAILURE; reason is the exception class.",
                               [*labels, "reason"], registry=registry)
        self.revoked = Counter("asyncinfer_inference_request_revoked",
                               "Requests revoked or expired before they ran.", labels,
                               registry=registry)
        self.retries = Counter("asyncinfer_inference_retries",
                               "Requests sent back for another try.", labels, registry=registry)
        self.queue = Histogram("asyncinfer_inference_queue_duration_seconds",
                               "Per request: taken from the queue by the worker → its batch starts.",
                               labels, buckets=_DURATION_BUCKETS_S, registry=registry)
        self.compute = Histogram("asyncinfer_inference_compute_duration_seconds",
                                 "Per device batch: batch start → results on the host (prepare, "
                                 "forward, copy).", labels, buckets=_DURATION_BUCKETS_S,
                                 registry=registry)
        self.batch = Histogram("asyncinfer_inference_batch_size", "Rows per device batch.",
                               labels, buckets=_BATCH_BUCKETS, registry=registry)


class _Children:
    """The labelled children of one (model, device), looked up once."""

    __slots__ = ("success", "revoked", "retries", "queue", "compute", "batch", "failures", "labels",
                 "_failure")

    def __init__(self, families: _Families, model: str, device: str) -> None:
        self.labels = (model, device)
        self.success = families.success.labels(model, device)
        self.revoked = families.revoked.labels(model, device)
        self.retries = families.retries.labels(model, device)
        self.queue = families.queue.labels(model, device)
        self.compute = families.compute.labels(model, device)
        self.batch = families.batch.labels(model, device)
        self._failure = families.failure
        self.failures: dict[str, Any] = {}

    def failure(self, reason: str) -> Any:
        child = self.failures.get(reason)
        if child is None:
            child = self.failures[reason] = self._failure.labels(*self.labels, reason)
        return child


class Ring:
    """Finished requests per second over the last ``window_s`` seconds."""

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


class WorkerMetrics:
    """One worker's counters, histograms and gauges, on a registry of its own."""

    def __init__(self, device: str = "") -> None:
        self.registry = process_registry()
        self._families = _Families(self.registry)
        self._children: dict[tuple[str, str], _Children] = {}
        self._children_lock = threading.Lock()
        self._finished = Ring(THROUGHPUT_WINDOW_S)
        self.device = device
        self._pending: Callable[[], dict[str, int]] | None = None
        self._in_flight: Callable[[], int] | None = None
        self.registry.register(_Gauges(self))
        self._server: Any = None
        #: What the fleet statistics get from this worker (flushed to Redis by its StatsFlusher).
        self.stats = StatsCounts()

    def _of(self, model: str, device: str) -> _Children:
        found = self._children.get((model, device))
        if found is None:
            with self._children_lock:
                found = self._children.get((model, device))
                if found is None:
                    found = self._children[(model, device)] = _Children(self._families, model,
                                                                         device)
        return found

    def record_batch(self, model: str, device: str, rows: int, compute_s: float,
                     queue_waits_s: Sequence[float] = (),
                     phases_s: tuple[float, float, float] | None = None) -> None:
        """One device batch of ``rows`` rows took ``compute_s`` (``phases_s``: preprocess, device,
        postprocess); its requests waited ``queue_waits_s``."""
        self.stats.record_batch(model, rows, len(queue_waits_s), queue_waits_s,
                                phases_s or (0.0, compute_s, 0.0))
        children = self._of(model, device)
        children.batch.observe(rows)
        children.compute.observe(compute_s)
        observe = children.queue.observe
        for wait_s in queue_waits_s:
            observe(wait_s)

    def record_outcome(self, model: str, device: str, state: str,
                       exc: BaseException | None = None, duration_s: float = 0.0) -> None:
        """One request ended in ``state`` (Celery's ``SUCCESS``, ``FAILURE``, ``REVOKED``),
        ``duration_s`` after the worker took it (0: not known)."""
        children = self._of(model, device)
        if state == "SUCCESS":
            children.success.inc()
        elif state == "REVOKED":
            children.revoked.inc()
        else:
            children.failure(type(exc).__name__ if exc is not None else state).inc()
            self.stats.record_failure(model, duration_s)
        self._finished.add(1)

    def count_retry(self, model: str, device: str) -> None:
        """One request of ``model`` on ``device`` goes back for another try."""
        self._of(model, device).retries.inc()

    def throughput_per_s(self) -> float:
        """Requests this worker finished per second, over the last ~10 s."""
        return self._finished.rate()

    # -- gauges read at scrape time ------------------------------------------------------------

    def watch(self, *, device: str | None = None,
              pending: Callable[[], dict[str, int]] | None = None,
              in_flight: Callable[[], int] | None = None) -> None:
        """Register where the gauges come from: ``pending()`` per model, ``in_flight()``."""
        if device is not None:
            self.device = device
        if pending is not None:
            self._pending = pending
        if in_flight is not None:
            self._in_flight = in_flight

    def in_flight_now(self) -> int:
        """Requests taken by the worker and not yet answered (0 when nothing is registered)."""
        return int(self._in_flight()) if self._in_flight is not None else 0

    def pending_now(self) -> dict[str, int]:
        """Requests waiting in the batchers, per model (empty when nothing is registered)."""
        return self._pending() if self._pending is not None else {}

    def serve(self, port: int, addr: str = "0.0.0.0") -> bool:
        """Serve ``/metrics`` on ``port`` (once); False if the port is taken."""
        if self._server is not None:
            return True
        try:
            self._server = start_http_server(port, addr, registry=self.registry)
        except OSError as exc:
            log.warning("metrics: cannot serve on port %d (%s); not serving metrics", port, exc)
            return False
        log.info("metrics on http://%s:%d/metrics", addr, port)
        return True

    def close(self) -> None:
        """Stop serving ``/metrics`` (if served)."""
        server, self._server = self._server, None
        if server is not None:
            server[0].shutdown()
            server[0].server_close()


class _Gauges(Collector):
    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        device = self.metrics.device
        pending = GaugeMetricFamily("asyncinfer_inference_pending_requests",
                                    "Requests waiting in the batcher for the device.",
                                    labels=["model", "device"])
        for model, n in sorted(self.metrics.pending_now().items()):
            pending.add_metric([model, device], n)
        yield pending
        in_flight = GaugeMetricFamily("asyncinfer_inference_in_flight_requests",
                                      "Requests taken from the queues and not yet answered.",
                                      labels=["device"])
        in_flight.add_metric([device], self.metrics.in_flight_now())
        yield in_flight
