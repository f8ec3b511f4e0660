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
from collections.abc import Callable
from typing import Any

from celery.worker import control, state
from kombu import Exchange, Queue

from asyncinfer.constants import TASK_NAME
from asyncinfer.worker.intake.holdings import ACTIVE, SCHEDULED, Holding

__all__ = ["serve", "count_started", "request_info"]

#: The fast consumer's queues and its in-flight bound, once it runs in this process.
_fast_queues: list[str] = []
_max_in_flight = [0]
#: ``held()``, the fast consumer's holdings; ``waiting()``, the IDs waiting in the batchers.
_sources: dict[str, Callable[[], Any]] = {}
_hostname = [""]
_celery = {name: control.Panel.data[name] for name in ("stats", "active", "reserved", "scheduled")}


def serve(queues: list[str], max_in_flight: int, *, hostname: str = "",
          held: Callable[[], list[Holding]] | None = None,
          waiting: Callable[[], set[str]] | None = None) -> None:
    """Say, from now on, that this worker also serves ``queues``, ``max_in_flight`` at once, and
    holds what ``held()`` returns (of which ``waiting()`` are in the batchers)."""
    _fast_queues[:] = queues
    _max_in_flight[0] = max_in_flight
    _hostname[0] = hostname
    if held is not None:
        _sources["held"] = held
    if waiting is not None:
        _sources["waiting"] = waiting


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


def _held(kind: str) -> list[Holding]:
    """The fast consumer's requests that are ``active``, ``reserved`` or ``scheduled`` now."""
    source = _sources.get("held")
    if source is None:
        return []
    held = [h for h in source() if h.delivery.request_id]
    if kind == SCHEDULED:
        return [h for h in held if h.state == SCHEDULED]
    waiting = _sources["waiting"]() if "waiting" in _sources else set()
    on_device = [h for h in held if h.state == ACTIVE and h.delivery.request_id not in waiting]
    if kind == ACTIVE:
        return on_device
    ids = {id(h) for h in on_device}
    return [h for h in held if h.state != SCHEDULED and id(h) not in ids]


def count_started(n: int = 1) -> None:
    """Count ``n`` started requests in Celery's ``inspect stats`` totals."""
    state.total_count[TASK_NAME] += n
    state.all_total_count[0] += n


@control.inspect_command()
def active_queues(panel: Any) -> list[dict[str, Any]]:
    """List the task queues a worker is currently consuming from (Celery's and the fast
    consumer's)."""
    consumer = panel.consumer.task_consumer
    own = [dict(q.as_dict(recurse=True)) for q in consumer.queues] if consumer else []
    names = {q.get("name") for q in own}
    return own + [dict(Queue(name, Exchange(name), routing_key=name).as_dict(recurse=True))
                  for name in _fast_queues if name not in names]


@control.inspect_command()
def stats(panel: Any, **kwargs: Any) -> dict[str, Any]:
    """Request worker statistics/information (the fast consumer's bound as the concurrency)."""
    reply: dict[str, Any] = _celery["stats"](panel, **kwargs)
    if _max_in_flight[0] and isinstance(reply.get("pool"), dict):
        reply["pool"] = {**reply["pool"], "max-concurrency": _max_in_flight[0]}
    return reply


@control.inspect_command(alias="dump_active")
def active(panel: Any, safe: bool = False, **kwargs: Any) -> list[dict[str, Any]]:
    """List of tasks currently being executed (Celery's, and the fast consumer's on the device)."""
    own: list[dict[str, Any]] = _celery["active"](panel, safe=safe, **kwargs)
    return own + [request_info(h, _hostname[0]) for h in _held(ACTIVE)]


@control.inspect_command(alias="dump_reserved")
def reserved(panel: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """List of currently reserved tasks, not including scheduled/active (Celery's, and the fast
    consumer's taken and waiting)."""
    own: list[dict[str, Any]] = _celery["reserved"](panel, **kwargs)
    return own + [request_info(h, _hostname[0]) for h in _held("reserved")]


@control.inspect_command(alias="dump_schedule")
def scheduled(panel: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """List of currently scheduled ETA/countdown tasks (Celery's, and the fast consumer's)."""
    own: list[dict[str, Any]] = _celery["scheduled"](panel, **kwargs)
    return own + [{"eta": _eta_of(h), "priority": h.delivery.envelope.get("properties", {}).get(
        "priority"), "request": request_info(h, _hostname[0])} for h in _held(SCHEDULED)]


def _eta_of(holding: Holding) -> str | None:
    eta = holding.delivery.headers.get("eta")
    return eta if isinstance(eta, str) else None
