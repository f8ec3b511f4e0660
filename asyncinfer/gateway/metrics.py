"""The gateway's Prometheus metrics, on its own registry, served at ``/metrics`` on the metrics port.

- ``asyncinfer_gateway_requests_total{model, protocol, code}``: infer calls by HTTP status (a gRPC
  call counts under the HTTP status its code maps from; 499 = the client went away);
- ``asyncinfer_gateway_request_duration_seconds{model, protocol}``: call received → answered;
- ``asyncinfer_gateway_in_flight``: infer calls being answered now;
- ``process_*``, ``python_*``: the gateway process' CPU, memory and collections, as a worker's;
- ``asyncinfer_queue_depth{model}`` and ``asyncinfer_queue_oldest_age_seconds{model}``: requests
  waiting in each known model's queue (all priority lists) and how long the oldest has waited (from
  the send time our producers stamp on a message) — what an autoscaler such as KEDA scales on.
  Read from the broker when scraped (each model's own, with a routing table), in the scrape's own
  thread.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import redis
from prometheus_client import Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from asyncinfer.constants import priority_lists, queue_for
from asyncinfer.gateway.tensors import InferCall
from asyncinfer.metrics_registry import process_registry
from asyncinfer.wire.clock import now_s
from asyncinfer.wire.messages import SENT_AT

__all__ = ["GatewayMetrics", "UNKNOWN_MODEL"]

log = logging.getLogger(__name__)

_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
              30.0)


class _Queues(Collector):
    """Depth and oldest-request age of each model's queue, read when scraped."""

    def __init__(self, broker_for: Callable[[str], Any] | None,
                 models: Callable[[], Iterable[str]]) -> None:
        #: model → the Redis client of its broker (None for a model, or no such function: not read)
        self.broker_for: Callable[[str], Any] = broker_for or (lambda model: None)
        self.models = models

    def collect(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily("asyncinfer_queue_depth",
                                  "Requests waiting in the model's queue.", labels=["model"])
        age = GaugeMetricFamily("asyncinfer_queue_oldest_age_seconds",
                                "Seconds the oldest waiting request of the model has waited.",
                                labels=["model"])
        by_broker: dict[int, tuple[Any, list[str]]] = {}
        for m in sorted(self.models()):
            broker = self.broker_for(m)
            if broker is not None:
                by_broker.setdefault(id(broker), (broker, []))[1].append(m)
        for broker, models in by_broker.values():
            try:
                self._read(broker, models, depth, age)
            except redis.RedisError as exc:
                log.debug("queue gauges not read: %s", exc)
        yield depth
        yield age

    def _read(self, broker: Any, models: list[str], depth: GaugeMetricFamily,
              age: GaugeMetricFamily) -> None:
        pipe = broker.pipeline(transaction=False)
        lists = {m: priority_lists([queue_for(m)]) for m in models}
        for m in models:
            for key in lists[m]:
                pipe.llen(key)
                pipe.lindex(key, -1)  # LPUSH in, taken from the right: the oldest is last
        replies = iter(pipe.execute())
        now = now_s()  # the messages' times are on the broker's clock
        for m in models:
            waiting, oldest = 0, None
            for _ in lists[m]:
                waiting += int(next(replies))
                sent = _sent_at(next(replies))
                if sent is not None:
                    oldest = sent if oldest is None else min(oldest, sent)
            depth.add_metric([m], waiting)
            age.add_metric([m], max(0.0, now - oldest) if oldest is not None and waiting else 0.0)


def _sent_at(raw: Any) -> float | None:
    if not raw:
        return None
    try:
        value = json.loads(raw)["properties"].get(SENT_AT)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


#: The model label of calls for a model the fleet does not know (404).
UNKNOWN_MODEL = "(unknown)"


class GatewayMetrics:
    """The gateway's metrics; :meth:`record` is the service's ``on_infer``."""

    def __init__(self, broker_for: Callable[[str], Any] | None,
                 models: Callable[[], Iterable[str]], in_flight: Callable[[], int]) -> None:
        self.registry = process_registry()
        self._requests = Counter("asyncinfer_gateway_requests", "Infer calls answered, by status.",
                                 ["model", "protocol", "code"], registry=self.registry)
        self._duration = Histogram("asyncinfer_gateway_request_duration_seconds",
                                   "Infer call received → answered.", ["model", "protocol"],
                                   buckets=_BUCKETS_S, registry=self.registry)
        #: (model, protocol, status) → its counter and duration histogram.
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self._in_flight = _InFlight(in_flight)
        self.registry.register(self._in_flight)
        self.registry.register(_Queues(broker_for, models))

    def record(self, call: InferCall, status: int, seconds: float) -> None:
        """Count a call answered with ``status`` after ``seconds``. A call answered 404 (a model,
        or a version, the fleet does not know) counts under the model label ``UNKNOWN_MODEL``: a
        series per name a caller makes up would grow the gateway's memory and every scrape
        without bound."""
        model = call.model if status != 404 else UNKNOWN_MODEL
        key = (model, call.protocol, status)
        children = self._children.get(key)
        if children is None:  # a label look-up per call costs more (prometheus_client's lock)
            children = self._children[key] = (
                self._requests.labels(model, call.protocol, str(status)),
                self._duration.labels(model, call.protocol))
        children[0].inc()
        children[1].observe(seconds)

    def serve(self, host: str, port: int) -> Any:
        """Serve ``/metrics`` on ``host:port`` (a thread of prometheus_client's)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server


class _InFlight(Collector):
    def __init__(self, in_flight: Callable[[], int]) -> None:
        self.in_flight = in_flight

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("asyncinfer_gateway_in_flight", "Infer calls being answered now.",
                                value=self.in_flight())
