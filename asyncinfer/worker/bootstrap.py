"""Worker start-up: load the hosted models inside the process that owns the device.

Connected to Celery's worker signals, so ``celery -A asyncinfer worker -Q infer.mlp`` and
``asyncinfer worker`` behave the same. In a threads or solo pool the models load in the worker
process before it consumes; in prefork they load in each child after the fork, never in the parent.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from celery import Celery, signals, states
from celery.concurrency import get_implementation
from celery.worker import state as worker_state
from celery.worker.control import inspect_command

from asyncinfer.constants import TASK_NAME, model_from_queue
from asyncinfer.worker import dead_letters, metrics
from asyncinfer.worker.events import FAILED_FORMAT
from asyncinfer.worker.runtime import close_runtime, get_runtime

__all__ = ["hosted_models"]

log = logging.getLogger(__name__)


def hosted_models(app: Celery) -> list[str]:
    """Models to load at start: the configured ones, else those of the consumed ``infer.*``
    queues (none for a worker that consumes no ``infer.*`` queue)."""
    configured = getattr(app, "asyncinfer_settings", None)
    if configured is not None and configured.models:
        return list(configured.models)
    queues = app.amqp.queues.consume_from or {}
    # A worker of other queues (the CPU stages, say) loads models lazily, when first asked.
    return [m for q in queues if (m := model_from_queue(q)) is not None]


def _is_prefork(pool_cls: Any) -> bool:
    cls = get_implementation(pool_cls) if isinstance(pool_cls, str) else pool_cls
    return "prefork" in getattr(cls, "__module__", "")


def _load(app: Celery) -> None:
    hosted = hosted_models(app)
    settings = getattr(app, "asyncinfer_settings", None)
    if settings is not None and hosted and not settings.models:
        # ``celery -A asyncinfer worker -Q infer.mlp``: it hosts the models of its queues, and
        # loads no other when a request names one (UnknownModel instead).
        settings = dataclasses.replace(settings, models=tuple(hosted))
    runtime = get_runtime(settings)
    runtime.load(hosted)
    log.info("asyncinfer worker on %s hosts %s", runtime.device.label, ", ".join(runtime.models))
    # Celery's stock path: its active requests are those in flight (the fast consumer, when it
    # starts, registers its own count instead).
    metrics.watch(device=runtime.device.label, pending=runtime.pending,
                  in_flight=lambda: len(worker_state.active_requests))
    port = runtime.settings.metrics_port
    if port:
        metrics.serve(port)


@signals.worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    if sender is not None and not _is_prefork(sender.pool_cls):
        _load(sender.app)


@signals.worker_process_init.connect
def _on_worker_process_init(**_: Any) -> None:
    from asyncinfer.celery_app import app

    _load(app)


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    close_runtime()


# -- Celery's stock path (``celery -A asyncinfer worker``, ``ASYNCINFER_CONSUMER=celery``) -----------

class _OneFailureLine(logging.Filter):
    """Drops the ERROR line Celery's tracer writes for a failed ``asyncinfer.infer``: the
    ``task_failure`` handler below writes the request's one failure line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        data = getattr(record, "data", None)
        return not (record.levelno >= logging.ERROR and isinstance(data, dict)
                    and data.get("name") == TASK_NAME)


logging.getLogger("celery.app.trace").addFilter(_OneFailureLine())


def _model_of(args: Any, kwargs: Any) -> str:
    request = kwargs if isinstance(kwargs, dict) and "model" in kwargs else (
        args[0] if args and isinstance(args[0], dict) else {})
    return str(request.get("model", "?"))


@signals.task_success.connect
def _on_task_success(sender: Any = None, result: Any = None, **_: Any) -> None:
    if getattr(sender, "name", None) == TASK_NAME:
        model = result.get("model_name", "?") if isinstance(result, dict) else "?"
        metrics.record_outcome(str(model), get_runtime().device.label, states.SUCCESS)


@signals.task_failure.connect
def _on_task_failure(sender: Any = None, task_id: Any = None, exception: Any = None,
                     args: Any = None, kwargs: Any = None, **_: Any) -> None:
    if getattr(sender, "name", None) != TASK_NAME:
        return
    model = _model_of(args, kwargs)
    worker = getattr(getattr(sender, "request", None), "hostname", None) or "?"
    log.warning(FAILED_FORMAT, task_id, model, worker, type(exception).__name__, exception)
    metrics.record_outcome(model, get_runtime().device.label, states.FAILURE, exception)
    dead_letters.add_stock_failure(sender, str(task_id or ""), exception)


@inspect_command()  # type: ignore[misc]
def asyncinfer_info(state: Any, **_: Any) -> dict[str, Any]:
    """Control command behind ``asyncinfer status``: this worker's device, models, requests pending
    in the batchers, requests in flight and finished requests per second over the last ~10 s."""
    runtime = get_runtime()
    return {"device": runtime.device.label, "models": runtime.models, "pid": os.getpid(),
            "pending": runtime.pending(), "in_flight": metrics.in_flight_now(),
            "throughput_per_s": round(metrics.throughput_per_s(), 2)}
