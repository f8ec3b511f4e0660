"""Worker start-up: load the hosted models inside the process that owns the device.

Connected to Celery's worker signals, so ``celery -A asyncinfer worker -Q infer.mlp`` and
``asyncinfer worker`` behave the same. The models load in the worker process (its pool threads
or solo) before it consumes, and are announced in the model catalogue (announcer.py) right after,
in ``worker_init``, before any consumer starts: the first request a worker answers finds its
model in the catalogue. A pool that forks (prefork) runs no model: a device worker refuses to
start with one (worker/step.py), and any other worker of the app refuses
``asyncinfer.infer`` (worker/celery_consumer.py); its children run the CPU stages only.

On a clean stop the models are withdrawn first (``worker_shutting_down``, before Celery's
consumer and the fast consumer give their requests back), so no client is sent to a worker that
is leaving.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from celery import Celery, signals
from celery.worker.control import inspect_command

from asyncinfer.config.bound import settings_of
from asyncinfer.config.settings import Settings
from asyncinfer.constants import queue_for
from asyncinfer.supervision.supervisor import CANNOT_START
from asyncinfer.wire.model_versions import split_key
from asyncinfer.worker import (
    inspection,  # noqa: F401 - registers the inspection commands
    model_control,  # noqa: F401 - registers the model control commands
)
from asyncinfer.worker.runtime import LoadFailed
from asyncinfer.worker.step import is_prefork
from asyncinfer.worker.worker import Worker, worker_of

__all__ = ["hosted_models", "take_atomically", "withdraw_when_stopping"]

log = logging.getLogger(__name__)


def hosted_models(app: Celery) -> list[str]:
    """Models to load at start: the configured ones, else those of the consumed ``infer.*``
    queues (none for a worker that consumes no ``infer.*`` queue)."""
    worker = worker_of(app)
    return worker.hosted_models()


def _load(worker: Worker) -> None:
    hosted = worker.hosted_models()
    try:
        worker.load(hosted)
    except Exception as exc:  # noqa: BLE001 - Celery's signal would log it and serve no model
        # A worker that cannot load what it must host must not report ready: one line, then the
        # status its supervisor (``asyncinfer up``) reads as "cannot start as configured".
        line = str(exc) if isinstance(exc, LoadFailed) else \
            f"loading {', '.join(hosted)} failed: {type(exc).__name__}: {exc}"
        print(f"asyncinfer worker: cannot start: {line}", file=sys.stderr, flush=True)
        log.debug("loading failed", exc_info=True)
        logging.shutdown()
        os._exit(CANNOT_START)
    _leave_failed_queues(worker)


def _leave_failed_queues(worker: Worker) -> None:
    """Consume no queue of a model that failed to load here (none of its versions loaded): its
    requests wait for a worker that serves it, or for a model control load here."""
    runtime = worker.runtime
    serving = {split_key(m)[0] for m in runtime.models}
    queues = worker.app.amqp.queues
    for model in {split_key(m)[0] for m in runtime.failed} - serving:
        if queue_for(model) in (queues.consume_from or {}):
            queues.deselect(queue_for(model))


def _retry_result_writes(app: Celery) -> None:
    """A worker stores every result through a lost connection or a refusal of Redis (a full
    disk, say), with Celery's backoff, instead of dropping it: for a task Celery's tracer runs (the
    CPU stages), a result that was not stored is a request lost once its message is
    acknowledged."""
    app.conf.result_backend_always_retry = True
    app.backend.always_retry = True  # the backend already made (others read the setting)


def take_atomically(app: Celery, node: str = "") -> None:
    """A worker's Celery consumer on Redis takes as the fast consumer does: pop, record in
    kombu's bookkeeping and lease to this worker (``node``) in one atomic step
    (asyncinfer/broker/atomic_take.py), so that a kill at any moment loses nothing and what a dead
    worker held comes back within the lease. (A client consumes only replies it does not
    acknowledge: kombu's BRPOP.)"""
    settings = settings_of(app) or Settings.from_env()
    app.conf.broker_transport_options = {**(app.conf.broker_transport_options or {}),
                                         "atomic_take": True, "lease_s": settings.lease_s,
                                         "lease_node": node,
                                         "lease_deaths": settings.max_worker_deaths > 0,
                                         "lease_deaths_ttl_s": settings.result_expires_s,
                                         "max_body_bytes": settings.max_payload_bytes}


def withdraw_when_stopping(worker: Worker) -> Callable[..., None]:
    """Withdraw ``worker``'s models when a clean stop of it begins (Celery's
    ``worker_shutting_down``, sent before anything is given back); returns the receiver."""

    def shutting_down(sender: Any = None, **_: Any) -> None:
        if sender == worker.name:  # Celery names the worker that stops
            worker.withdraw()

    signals.worker_shutting_down.connect(shutting_down, weak=False)
    return shutting_down


@signals.worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    if sender is None:
        return
    # The device worker of this Celery worker: made by ``asyncinfer worker``, else here.
    worker = worker_of(sender.app)
    worker.name = str(getattr(sender, "hostname", "") or worker.name)
    sender.asyncinfer = worker
    withdraw_when_stopping(worker)
    _retry_result_writes(sender.app)
    take_atomically(sender.app, worker.name)
    if not is_prefork(sender.pool_cls):
        _load(worker)
        # Before the blueprint starts any consumer: nothing is taken before the models are in
        # the catalogue.
        worker.announce()


@signals.worker_shutdown.connect
def _on_worker_shutdown(sender: Any = None, **_: Any) -> None:
    worker = getattr(sender, "asyncinfer", None)
    if worker is not None:
        worker.close()


@inspect_command()  # type: ignore[misc]
def asyncinfer_info(state: Any, **_: Any) -> dict[str, Any]:
    """Control command behind ``asyncinfer status``: this worker's device, models, requests pending
    in the batchers, requests in flight and finished requests per second over the last ~10 s."""
    worker = getattr(state.consumer.controller, "asyncinfer", None) or worker_of(state.consumer.app)
    return worker.info()
