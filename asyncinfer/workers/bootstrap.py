"""Worker start-up: load the hosted models inside the process that owns the device.

Connected to Celery's worker signals, so ``celery -A asyncinfer worker -Q infer.mlp`` and
``asyncinfer worker`` behave the same. In a threads or solo pool the models load in the worker
process before it consumes; in prefork they load in each child after the fork, never in the parent.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery, signals
from celery.concurrency import get_implementation
from celery.worker.control import inspect_command

from asyncinfer.constants import model_from_queue
from asyncinfer.workers.runtime import close_runtime, get_runtime

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
    runtime = get_runtime()
    runtime.load(hosted_models(app))
    log.info("asyncinfer worker on %s hosts %s", runtime.device.label, ", ".join(runtime.models))


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


@inspect_command()  # type: ignore[misc]
def asyncinfer_info(state: Any, **_: Any) -> dict[str, Any]:
    """Control command behind ``asyncinfer status``: this worker's device, models, pending rows."""
    runtime = get_runtime()
    return {"device": runtime.device.label, "models": runtime.models, "pid": os.getpid(),
            "pending": runtime.pending()}
