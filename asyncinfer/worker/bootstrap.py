"""Worker start-up: load the hosted models inside the process that owns the device.

Connected to Celery's worker signals, so ``celery -A asyncinfer worker -Q infer.mlp`` and
``asyncinfer worker`` behave the same. In a threads or solo pool the models load in the worker
process before it consumes, and are announced in the model catalogue (announcer.py) right after,
in ``worker_init``, before any consumer starts: the first request a worker answers finds its
model in the catalogue. In prefork they load in each child after the fork, never in the parent;
a child announces before it runs anything.

On a clean stop the models are withdrawn first (``worker_shutting_down``, before Celery's
consumer and the fast consumer give their requests back), so no client is sent to a worker that
is leaving.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

from celery import Celery, signals
from celery.worker import state as worker_state
from celery.worker.control import inspect_command

from asyncinfer.config.bound import settings_of
from asyncinfer.config.settings import Settings
from asyncinfer.constants import model_from_queue
from asyncinfer.worker import announcer, metrics
from asyncinfer.worker.intake.step import fast_queues, is_prefork
from asyncinfer.worker.runtime import close_runtime, existing_runtime, get_runtime
from asyncinfer.worker.supervisor import CANNOT_START

__all__ = ["hosted_models", "take_atomically"]

log = logging.getLogger(__name__)


def hosted_models(app: Celery) -> list[str]:
    """Models to load at start: the configured ones, else those of the consumed ``infer.*``
    queues (none for a worker that consumes no ``infer.*`` queue)."""
    configured = settings_of(app)
    if configured is not None and configured.models:
        return list(configured.models)
    # the fast consumer's queues were Celery's until its step took them
    queues = [*fast_queues(app), *(app.amqp.queues.consume_from or {})]
    # A worker of other queues (the CPU stages, say) loads models lazily, when first asked.
    return list(dict.fromkeys(m for q in queues if (m := model_from_queue(q)) is not None))


def _load(app: Celery) -> None:
    hosted = hosted_models(app)
    settings = settings_of(app)
    if settings is not None and hosted and not settings.models:
        # ``celery -A asyncinfer worker -Q infer.mlp``: it hosts the models of its queues, and
        # loads no other when a request names one (UnknownModel instead).
        settings = dataclasses.replace(settings, models=tuple(hosted))
    runtime = get_runtime(settings)
    try:
        runtime.load(hosted)
    except Exception as exc:  # noqa: BLE001 - Celery's signal would log it and serve no model
        # A worker that cannot load what it hosts must not report ready: one line, then the
        # status its supervisor (``asyncinfer up``) reads as "cannot start as configured".
        print(f"asyncinfer worker: cannot start: loading {', '.join(hosted)} failed: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        log.debug("loading failed", exc_info=True)
        logging.shutdown()
        os._exit(CANNOT_START)
    log.info("asyncinfer worker on %s hosts %s", runtime.device.label, ", ".join(runtime.models))
    # Celery's stock path: its active requests are those in flight (the fast consumer, when it
    # starts, registers its own count instead).
    metrics.watch(device=runtime.device.label, pending=runtime.pending,
                  in_flight=lambda: len(worker_state.active_requests))
    port = runtime.settings.metrics_port
    if port:
        metrics.serve(port)


#: This worker's name (``celery@host``), known from ``worker_init`` (and kept across prefork's fork).
_worker_name = [""]


def _announce(worker: str) -> None:
    """Put this process's models in the model catalogue (announcer.py) until the worker stops."""
    runtime = existing_runtime()
    if runtime is None or not runtime.models:
        return

    def hosted() -> list[dict[str, Any]]:
        return [r.model.metadata(r.options) for r in runtime.runners()]

    announcer.start(runtime.settings, worker, runtime.device.label, hosted)


def _retry_result_writes(app: Celery) -> None:
    """A worker stores every result through a lost connection or a refusal of Redis (a full
    disk, say), with Celery's backoff, instead of dropping it: on Celery's stock path a result that
    was not stored is a request lost once its message is acknowledged."""
    app.conf.result_backend_always_retry = True
    app.backend.always_retry = True  # the backend already made (others read the setting)


def take_atomically(app: Celery, node: str = "") -> None:
    """A worker's Celery consumer on Redis takes as the fast consumer does: pop, record in
    kombu's bookkeeping and lease to this worker (``node``) in one atomic step
    (asyncinfer/kombu_take.py), so that a kill at any moment loses nothing and what a dead
    worker held comes back within the lease. (A client consumes only replies it does not
    acknowledge: kombu's BRPOP.)"""
    settings = settings_of(app) or Settings.from_env()
    app.conf.broker_transport_options = {**(app.conf.broker_transport_options or {}),
                                         "atomic_take": True, "lease_s": settings.lease_s,
                                         "lease_node": node}


@signals.worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    if sender is not None:
        _worker_name[0] = str(getattr(sender, "hostname", "") or "")
        _retry_result_writes(sender.app)
        take_atomically(sender.app, _worker_name[0])
    if sender is not None and not is_prefork(sender.pool_cls):
        _load(sender.app)
        # Before the blueprint starts any consumer: nothing is taken before the models are in
        # the catalogue. (A prefork child announces itself once loaded.)
        _announce(_worker_name[0])


@signals.worker_shutting_down.connect
def _on_worker_shutting_down(**_: Any) -> None:
    # A clean stop begins: withdraw before any request is given back.
    announcer.stop()


@signals.worker_process_init.connect
def _on_worker_process_init(**_: Any) -> None:
    from asyncinfer.celery_app import app

    _retry_result_writes(app)
    _load(app)
    _announce(f"{_worker_name[0]}/{os.getpid()}")


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    announcer.stop()
    close_runtime()


@signals.worker_process_shutdown.connect
def _on_worker_process_shutdown(**_: Any) -> None:
    announcer.stop()


@inspect_command()  # type: ignore[misc]
def asyncinfer_info(state: Any, **_: Any) -> dict[str, Any]:
    """Control command behind ``asyncinfer status``: this worker's device, models, requests pending
    in the batchers, requests in flight and finished requests per second over the last ~10 s."""
    runtime = get_runtime()
    return {"device": runtime.device.label, "models": runtime.models, "pid": os.getpid(),
            "pending": runtime.pending(), "in_flight": metrics.in_flight_now(),
            "throughput_per_s": round(metrics.throughput_per_s(), 2)}
