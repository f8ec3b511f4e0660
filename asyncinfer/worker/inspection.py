"""What Celery's remote inspection (``celery inspect``, Flower) says about a fast-consumer worker.

Celery answers from its own consumer, which reads only ``asyncinfer.control`` in a device worker,
and reports its pool of two threads as the worker's concurrency. Here the commands also say what
the fast consumer does:

- ``active_queues``: its ``infer.*`` queues too (so Flower's broker page lists them and their
  lengths); ``stats``: its in-flight bound as ``pool.max-concurrency``, and each request it starts
  counted in Celery's ``total``, as Celery's own consumer counts;
- ``active``: its requests on the device (handed to their model, out of the batcher);
  ``reserved``: those taken and waiting (being decoded, or in the batcher);
  ``scheduled``: those held until their ``eta`` (a retry's backoff). Each with Celery's request
  fields; ``args``/``kwargs`` are the message's ``argsrepr``/``kwargsrepr`` (Celery's ``safe``
  form: a request's tensors are not decoded for inspection).
"""

from __future__ import annotations

import os
from typing import Any

from celery.worker import control
from kombu import Exchange, Queue

from asyncinfer.worker.requests.holdings import ACTIVE, SCHEDULED, Holding
from asyncinfer.worker.worker import Worker, existing_worker

__all__ = ["request_info"]

#: Celery's own commands, which these extend (read once, when this module registers its own).
_CELERY = {name: control.Panel.data[name] for name in ("stats", "active", "reserved", "scheduled")}


def _worker(panel: Any) -> Worker | None:
    """The device worker the command reached (None: Celery's consumer alone serves)."""
    return getattr(panel.consumer.controller, "asyncinfer", None) \
        or existing_worker(panel.consumer.app)


def _consumer(panel: Any) -> Any:
    """The worker's fast consumer (None: Celery's consumer alone serves)."""
    worker = _worker(panel)
    return worker.consumer if worker is not None else None


def request_info(holding: Holding, hostname: str) -> dict[str, Any]:
    """Celery's ``Request.info(safe=True)`` of a held request."""
    d = holding.delivery
    headers = d.headers
    properties = d.envelope.get("properties") or {}
    info = properties.get("delivery_info") or {}
    return {"id": d.request_id, "name": headers.get("task"), "args": headers.get("argsrepr", ""),
            "kwargs": headers.get("kwargsrepr", ""), "type": headers.get("task"),
            "hostname": hostname, "time_start": holding.started_at,
            "acknowledged": False, "worker_pid": os.getpid(),
            "delivery_info": {"exchange": info.get("exchange", ""), "routing_key": d.queue,
                              "priority": properties.get("priority"),
                              "redelivered": bool(headers.get("redelivered"))}}


def _held(consumer: Any, kind: str) -> list[Holding]:
    """The fast consumer's requests that are ``active``, ``reserved`` or ``scheduled`` now."""
    if consumer is None:
        return []
    held = [h for h in consumer.holdings.held() if h.delivery.request_id]
    if kind == SCHEDULED:
        return [h for h in held if h.state == SCHEDULED]
    waiting = consumer.runtime.waiting_ids()
    on_device = [h for h in held if h.state == ACTIVE and h.delivery.request_id not in waiting]
    if kind == ACTIVE:
        return on_device
    ids = {id(h) for h in on_device}
    return [h for h in held if h.state != SCHEDULED and id(h) not in ids]


@control.inspect_command()
def active_queues(panel: Any) -> list[dict[str, Any]]:
    """List the task queues a worker is currently consuming from (Celery's and the fast
    consumer's)."""
    consumer = panel.consumer.task_consumer
    own = [dict(q.as_dict(recurse=True)) for q in consumer.queues] if consumer else []
    names = {q.get("name") for q in own}
    worker = _worker(panel)
    fast = worker.fast_queues if worker is not None and worker.consumer is not None else []
    return own + [dict(Queue(name, Exchange(name), routing_key=name).as_dict(recurse=True))
                  for name in fast if name not in names]


@control.inspect_command()
def stats(panel: Any, **kwargs: Any) -> dict[str, Any]:
    """Request worker statistics/information (the fast consumer's bound as the concurrency)."""
    reply: dict[str, Any] = _CELERY["stats"](panel, **kwargs)
    consumer = _consumer(panel)
    if consumer is not None and isinstance(reply.get("pool"), dict):
        reply["pool"] = {**reply["pool"], "max-concurrency": consumer.max_in_flight}
    return reply


@control.inspect_command(alias="dump_active")
def active(panel: Any, safe: bool = False, **kwargs: Any) -> list[dict[str, Any]]:
    """List of tasks currently being executed (Celery's, and the fast consumer's on the device)."""
    own: list[dict[str, Any]] = _CELERY["active"](panel, safe=safe, **kwargs)
    consumer = _consumer(panel)
    return own + [request_info(h, consumer.hostname) for h in _held(consumer, ACTIVE)]


@control.inspect_command(alias="dump_reserved")
def reserved(panel: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """List of currently reserved tasks, not including scheduled/active (Celery's, and the fast
    consumer's taken and waiting)."""
    own: list[dict[str, Any]] = _CELERY["reserved"](panel, **kwargs)
    consumer = _consumer(panel)
    return own + [request_info(h, consumer.hostname) for h in _held(consumer, "reserved")]


@control.inspect_command(alias="dump_schedule")
def scheduled(panel: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """List of currently scheduled ETA/countdown tasks (Celery's, and the fast consumer's)."""
    own: list[dict[str, Any]] = _CELERY["scheduled"](panel, **kwargs)
    consumer = _consumer(panel)
    return own + [{"eta": _eta_of(h), "priority": h.delivery.envelope.get("properties", {}).get(
        "priority"), "request": request_info(h, consumer.hostname)}
        for h in _held(consumer, SCHEDULED)]


def _eta_of(holding: Holding) -> str | None:
    eta = holding.delivery.headers.get("eta")
    return eta if isinstance(eta, str) else None
