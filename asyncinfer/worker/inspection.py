"""What Celery's remote inspection (``celery inspect``, Flower) says about a fast-consumer worker.

Celery answers ``active_queues`` from its own consumer, which reads only ``asyncinfer.control``
in a device worker, and reports its pool of two threads as the worker's concurrency. Here the two
commands also say what the fast consumer serves: its ``infer.*`` queues (so Flower's broker page
lists them and their lengths) and its in-flight bound as ``pool.max-concurrency``. The fast
consumer counts each request it starts in Celery's ``total`` (``inspect stats``), as Celery's
own consumer does.
"""

from __future__ import annotations

from typing import Any

from celery.worker import control, state
from kombu import Exchange, Queue

from asyncinfer.constants import TASK_NAME

__all__ = ["serve", "count_started"]

#: The fast consumer's queues and its in-flight bound, once it runs in this process.
_fast_queues: list[str] = []
_max_in_flight = [0]
_celery_stats = control.Panel.data["stats"]


def serve(queues: list[str], max_in_flight: int) -> None:
    """Say, from now on, that this worker also serves ``queues``, ``max_in_flight`` at once."""
    _fast_queues[:] = queues
    _max_in_flight[0] = max_in_flight


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
    reply: dict[str, Any] = _celery_stats(panel, **kwargs)
    if _max_in_flight[0] and isinstance(reply.get("pool"), dict):
        reply["pool"] = {**reply["pool"], "max-concurrency": _max_in_flight[0]}
    return reply
