"""Celery's stock request path through the one lifecycle (:mod:`asyncinfer.worker.lifecycle`).

``ASYNCINFER_CONSUMER=celery``, a RabbitMQ broker or a prefork pool run ``asyncinfer.infer``
through Celery's own consumer, request and tracer. They announce how each request ended through
Celery's signals; here each signal goes to the worker's :class:`Settlement`, so the failure line,
the metrics and the retry decision are those of the fast consumer. Admission is asked by the task
before it runs (:class:`~asyncinfer.tasks.infer.InferTask`), and for redelivered messages by the
consumer before Celery accepts them (:mod:`asyncinfer.worker.intake.celery_consumer`).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, signals

from asyncinfer.constants import TASK_NAME, model_from_queue
from asyncinfer.worker import dead_letters
from asyncinfer.worker.lifecycle import Settlement
from asyncinfer.worker.worker import worker_of

__all__ = ["settlement", "model_of"]

log = logging.getLogger(__name__)


def settlement(app: Celery) -> Settlement:
    """The settlement of ``asyncinfer.infer`` on Celery's stock path, of the app's worker."""
    worker = worker_of(app)
    return worker.settlement


def model_of(request: Any, args: Any = None, kwargs: Any = None) -> str:
    """The model of a request: its queue's (``infer.<model>``), else the v2 ``model`` its
    arguments name."""
    info = getattr(request, "delivery_info", None) or {}
    model = model_from_queue(str(info.get("routing_key") or ""))
    if model is not None:
        return model
    args = getattr(request, "args", None) if args is None else args
    kwargs = getattr(request, "kwargs", None) if kwargs is None else kwargs
    payload = kwargs if isinstance(kwargs, dict) and "model" in kwargs else (
        args[0] if isinstance(args, (list, tuple)) and args and isinstance(args[0], dict) else {})
    return str(payload.get("model", "?"))


def _hostname(task: Any) -> str:
    return str(getattr(getattr(task, "request", None), "hostname", None) or "?")


class _OneFailureLine(logging.Filter):
    """Drops the ERROR line Celery's tracer writes for a failed ``asyncinfer.infer``: the
    settlement writes the request's one failure line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        data = getattr(record, "data", None)
        return not (record.levelno >= logging.ERROR and isinstance(data, dict)
                    and data.get("name") == TASK_NAME)


logging.getLogger("celery.app.trace").addFilter(_OneFailureLine())


def _ours(task: Any) -> bool:
    return getattr(task, "name", None) == TASK_NAME


@signals.task_success.connect
def _on_task_success(sender: Any = None, result: Any = None, **_: Any) -> None:
    if _ours(sender):
        model = result.get("model_name", "?") if isinstance(result, dict) else "?"
        settlement(sender.app).succeeded(sender.request, str(model), result)


@signals.task_failure.connect
def _on_task_failure(sender: Any = None, task_id: Any = None, exception: Any = None,
                     args: Any = None, kwargs: Any = None, **_: Any) -> None:
    if not _ours(sender):
        return
    settlement(sender.app).failed(sender.request, model_of(sender.request, args, kwargs), exception,
                                  worker=_hostname(sender))
    worker = worker_of(sender.app)
    dead_letters.add_stock_failure(sender, str(task_id or ""), exception, worker=worker.name,
                                   broker=worker.broker)


@signals.task_retry.connect
def _on_task_retry(sender: Any = None, request: Any = None, reason: Any = None, **_: Any) -> None:
    if _ours(sender) and request is not None:
        exc = getattr(reason, "exc", None) or reason  # Celery's Retry, carrying the failure
        if not isinstance(exc, BaseException):
            exc = Exception(str(exc))
        settlement(sender.app).retrying(request, model_of(request), exc, int(request.retries or 0))


@signals.task_revoked.connect
def _on_task_revoked(sender: Any = None, request: Any = None, expired: Any = False,
                     **_: Any) -> None:
    # sender is the task; request is the worker's Request (its kwargs hold the v2 request)
    if _ours(sender) and request is not None:
        settlement(sender.app).revoked(request, model_of(request), bool(expired))
