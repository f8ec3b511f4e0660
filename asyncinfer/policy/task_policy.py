"""Which tasks a device worker's Celery consumer serves, queue by queue.

A device worker runs ``asyncinfer.infer``; on a queue that is neither an ``infer.*`` queue nor
the control queue (``asyncinfer.cpu`` beside ``infer.mlp``, say) it also runs the stage tasks
(``asyncinfer.preprocess``, ``asyncinfer.postprocess``) of the models it hosts. Everything else —
Celery's built-ins (``celery.accumulate``, ``celery.backend_cleanup``, ``celery.chord_unlock``,
``celery.group``, ``celery.chain``, ``celery.map``, ...), any other registered task, a stage task for
a model it does not host — is refused before Celery creates a request for it. A worker that reads
neither ``infer.*`` queues nor the control queue (the CPU stage worker) is not a device worker:
the policy leaves it to Celery.

The queue a message came by is the routing key it carries, which its producer wrote. A routing key
that names none of the worker's queues gets the strictest rule among the queues the worker reads,
so a forged one never widens what runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum

from asyncinfer.constants import (
    CONTROL_QUEUE,
    POSTPROCESS_TASK,
    PREPROCESS_TASK,
    QUEUE_PREFIX,
    TASK_NAME,
    model_from_queue,
)
from asyncinfer.errors import InvalidRequest
from asyncinfer.policy.admission import REFUSED, Admission

__all__ = ["STAGE_TASKS", "QueueKind", "TaskPolicy", "allow_infer_only", "refused_on_infer_queue"]

#: A model's CPU stages, served by a device worker on its stage queues for its own models.
STAGE_TASKS = (PREPROCESS_TASK, POSTPROCESS_TASK)


def refused_on_infer_queue(request_id: str, task: object, queue: str) -> InvalidRequest:
    """The error of a task other than ``asyncinfer.infer`` sent to an ``infer.*`` queue."""
    return InvalidRequest(f"request {request_id}: task {task!r} is refused: only {TASK_NAME} is "
                          f"served on queue {queue}")


def allow_infer_only(request_id: str, task: object, queue: str) -> Admission | None:
    """The allow-list of an ``infer.*`` queue, as admission: REFUSED for any task but
    ``asyncinfer.infer`` (no request makes a device worker run anything but inference)."""
    if task == TASK_NAME:
        return None
    return Admission(REFUSED, error=refused_on_infer_queue(request_id, task, queue))


class QueueKind(IntEnum):
    """What a queue of a device worker carries; a higher kind is a stricter rule."""

    STAGE = 0  # asyncinfer.infer and the stage tasks of the hosted models
    INFER = 1  # asyncinfer.infer only
    CONTROL = 2  # no task: remote control only


def kind_of(queue: str) -> QueueKind:
    """The kind of ``queue`` in a device worker."""
    if queue == CONTROL_QUEUE:
        return QueueKind.CONTROL
    if model_from_queue(queue) is not None:
        return QueueKind.INFER
    return QueueKind.STAGE


@dataclass(frozen=True)
class TaskPolicy:
    """The tasks a device worker serves: ``queues`` maps each routing key it reads to its queue."""

    queues: Mapping[str, str]
    hosted: tuple[str, ...]

    @classmethod
    def for_worker(cls, queues: Mapping[str, str], hosted: Iterable[str]) -> TaskPolicy | None:
        """The policy of a worker reading ``queues`` (routing key → queue), or None when it is not a
        device worker (it reads no ``infer.*`` queue and not the control queue)."""
        if not any(kind_of(q) > QueueKind.STAGE for q in queues.values()):
            return None
        return cls(dict(queues), tuple(hosted))

    def queue_of(self, routing_key: str) -> tuple[str, QueueKind]:
        """The queue a message with ``routing_key`` came by, and its rule: an unknown routing key
        gets the strictest rule of the worker's queues."""
        queue = self.queues.get(routing_key)
        if queue is not None:
            return queue, kind_of(queue)
        return routing_key or "?", max(kind_of(q) for q in self.queues.values())

    def needs_model(self, task: str, routing_key: str) -> bool:
        """Whether :meth:`refusal` needs the model the message names (a stage task on a stage queue)."""
        return task in STAGE_TASKS and self.queue_of(routing_key)[1] is QueueKind.STAGE

    def refusal(self, request_id: str, task: str, routing_key: str,
                model_of: Callable[[], str | None] = lambda: None) -> InvalidRequest | None:
        """The error refusing task ``task`` that came with ``routing_key``, or None if it is served.
        ``model_of`` reads the model a stage task names (called only for a stage task on a stage
        queue)."""
        queue, kind = self.queue_of(routing_key)
        who = f"request {request_id}: task {task!r}"
        if kind is QueueKind.CONTROL:
            return InvalidRequest(f"{who} is refused: no task is served on queue {queue} (it carries "
                                  f"remote control only; {TASK_NAME} goes to {QUEUE_PREFIX}<model>)")
        if task == TASK_NAME:
            return None
        if kind is QueueKind.INFER:
            return refused_on_infer_queue(request_id, task, queue)
        rule = (f"only {TASK_NAME} and the stage tasks of the models this worker hosts "
                f"({', '.join(self.hosted) or 'none'}) are served on queue {queue}")
        if task not in STAGE_TASKS:
            return InvalidRequest(f"{who} is refused: {rule}")
        model = model_of()
        if model is None:
            return InvalidRequest(f"{who} is refused: it names no model; {rule}")
        if model not in self.hosted:
            return InvalidRequest(f"{who} for model {model!r} is refused: {rule}")
        return None
