"""Model control on a running device worker: load a model and start taking its requests, or unload
one and give back what it holds of it — the worker's side of Triton's model repository extension,
reached through Celery's remote control (``asyncinfer_load_model`` / ``asyncinfer_unload_model``,
broadcast by :mod:`asyncinfer.client.model_control`).

**Load** (:func:`load_model`): the model is built and loaded on the worker's device (a registered
model, or a ``NAME.pt`` / ``NAME.pt2`` file of ``ASYNCINFER_MODEL_DIR`` under the usual loading
rules, a file added since the worker started included), announced in the model catalogue, and
then its queue ``infer.<model>`` is taken by the fast consumer. A load that fails (not registered,
no such file, a file the loading rules refuse, an error or out of memory while loading) frees what
it allocated and answers the reason; the worker serves what it served. Loading a model the worker
hosts already is a success that changes nothing (``loaded: false``).

**Unload** (:func:`unload_model`), in this order: the model leaves the worker's catalogue entry;
the fast consumer stops taking its queue (between two takes); what it holds of it and has not
started — retries waiting for their eta, requests waiting in the batcher — goes back to the queue
at once, for another worker (or a later load) to serve; what is on the device finishes and is
answered here (up to ``grace_s``); then the runner stops and its memory is given back (garbage
collected, the accelerator's cache emptied, the heap trimmed: engine/freeing.py). No request is
lost or answered twice: each one is answered here, or back on its queue, untouched.

**Versions** (wire/model_versions.py): version ``v`` of ``m`` is registered as ``m@v`` and loaded
beside the others, in a runner of its own, on the one queue ``infer.m``. Unloading one version
while others stay leaves the queue taken: the version is routed no more, what it took runs to its
end, nothing is given back (it would come back here). A load may name the factory of a version
the worker has not registered (``--factory pkg.mod:attr``): imported only from a module
``ASYNCINFER_LOADABLE_FACTORIES`` allows, registered, then loaded as above; a failed import or
load answers its one line and leaves nothing registered (worker/factory_loads.py).

Both run in Celery's consumer thread (remote control commands do), one at a time per worker. Model
control needs the fast consumer (the default on a Redis broker); a worker fed by Celery's consumer
(RabbitMQ, ``ASYNCINFER_CONSUMER=celery``) refuses it, saying so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from celery.worker.control import control_command, inspect_command

from asyncinfer.constants import model_from_queue, queue_for
from asyncinfer.errors import UnknownModel
from asyncinfer.wire.model_versions import sorted_versions, version_key
from asyncinfer.worker.consumers.consumer import STOP_GRACE_S
from asyncinfer.worker.factory_loads import forget, register_factory
from asyncinfer.worker.worker import Worker, worker_of

__all__ = ["load_model", "unload_model", "repository", "REPOSITORY_COMMAND", "LOAD_COMMAND", "UNLOAD_COMMAND"]

log = logging.getLogger(__name__)

LOAD_COMMAND = "asyncinfer_load_model"
UNLOAD_COMMAND = "asyncinfer_unload_model"
REPOSITORY_COMMAND = "asyncinfer_repository"


def _refusal(worker: Worker, model: str, error: str) -> dict[str, Any]:
    return {"ok": False, "model": model, "error": error, **_where(worker)}


def _where(worker: Worker) -> dict[str, Any]:
    if not worker.has_runtime():  # no device worker (a CPU stages' worker): none is made here
        return {"device": "", "models": [], "device_worker": False}
    runtime = worker.runtime
    return {"device": runtime.device.label, "models": runtime.models}


def _fast_consumer(worker: Worker) -> Any:
    """The worker's fast consumer, or the reason there is none to take a model's queue."""
    from asyncinfer.worker.consumers.fast_consumer import FastConsumer

    consumer = worker.consumer
    if not worker.has_runtime():
        return "it is no device worker (it runs no model)"
    if isinstance(consumer, FastConsumer) and not consumer.stopped:
        return consumer
    if consumer is None:
        return "the worker does not serve yet (or no longer): nothing takes its queues"
    if consumer.stopped:
        return "the worker is stopping"
    return ("model control needs the fast consumer (ASYNCINFER_CONSUMER=fast on a Redis broker); "
            "this worker is fed by Celery's consumer: restart it with the model instead")


def _what(model: str, version: str) -> str:
    return f"model '{model}'" + (f" version '{version}'" if version else "")


def load_model(worker: Worker, model: str, version: str = "", factory: str = "") -> dict[str, Any]:
    """Load ``model`` (its ``version``: ``model@version`` as registered) on ``worker``'s device
    and take its queue (see the module documentation); ``factory`` (``pkg.mod:attr``): register
    it as ``model@version`` first, if ``ASYNCINFER_LOADABLE_FACTORIES`` allows its module
    (worker/factory_loads.py)."""
    if not factory:
        return _load(worker, model, version)
    what = _what(model, version)
    consumer = _fast_consumer(worker)  # nothing imported on a worker that cannot load
    if isinstance(consumer, str):
        return _refusal(worker, model, f"cannot load {what}: {consumer}")
    try:
        registered = register_factory(worker.runtime, worker.command_factories, model, version,
                                      factory)
    except ValueError as exc:  # FactoryRefused, FactoryError, a name the registry refuses
        log.warning("load of %s from factory %s refused: %s", what, factory, exc)
        return _refusal(worker, model, f"cannot load {what}: {exc}")
    reply = _load(worker, model, version)
    if reply["ok"]:
        reply["factory"] = factory
    elif registered:  # not left registered: a later load without a factory finds none
        forget(worker.runtime, worker.command_factories, version_key(model, version))
    return reply


def _load(worker: Worker, model: str, version: str) -> dict[str, Any]:
    what = _what(model, version)
    consumer = _fast_consumer(worker)
    if isinstance(consumer, str):
        return _refusal(worker, model, f"cannot load {what}: {consumer}")
    runtime = worker.runtime
    began = time.perf_counter()
    try:
        key = runtime.key_for(model, version)
        if key in worker.leaving:
            return _refusal(worker, model, f"cannot load {what}: it is being unloaded here")
        loaded = runtime.load_one(key)
    except UnknownModel as exc:
        return _refusal(worker, model, str(exc))
    except Exception as exc:  # noqa: BLE001 - a failed load is answered; the worker serves on
        log.warning("load of %s failed (%s: %s); the worker serves %s", what,
                    type(exc).__name__, exc, ", ".join(runtime.models) or "nothing")
        return _refusal(worker, model, f"{what} failed to load on "
                                       f"{runtime.device.label}: {type(exc).__name__}: {exc}")
    worker.announce_now()  # in the catalogue before its first request is taken
    queue = queue_for(model)  # every version's requests come by the model's one queue
    if queue not in consumer.queues:
        if not consumer.set_queues([*consumer.queues, queue]):
            return _refusal(worker, model, f"{what} is loaded but its queue {queue} is "
                                           f"not taken: the worker stops")
        worker.fast_queues = list(consumer.queues)
    log.info("%s %s on %s (model control)", what, "loaded" if loaded else "was loaded",
             runtime.device.label)
    return {"ok": True, "model": model, "version": runtime.by_model()[key].model.version,
            "loaded": loaded, "load_s": round(time.perf_counter() - began, 3), **_where(worker)}


def unload_model(worker: Worker, model: str, grace_s: float = STOP_GRACE_S,
                 version: str = "") -> dict[str, Any]:
    """Unload ``model`` (every version; or only ``version``, the others serving on): see the
    module documentation."""
    what = _what(model, version)
    consumer = _fast_consumer(worker)
    if isinstance(consumer, str):
        return _refusal(worker, model, f"cannot unload {what}: {consumer}")
    runtime = worker.runtime
    versions = runtime.versions_of(model)
    keys = [k for k, v in versions.items() if not version or v == version]
    if not keys:
        loaded = (f"versions here: {', '.join(sorted_versions(versions.values()))}" if versions
                  else f"it hosts: {', '.join(runtime.models) or 'none'}")
        return _refusal(worker, model, f"{what} is not loaded on this worker ({loaded})")
    if any(k in worker.leaving for k in keys):
        return _refusal(worker, model, f"{what} is being unloaded here already")
    worker.leaving.update(keys)
    try:
        if len(keys) < len(versions):
            return _unload_version(worker, consumer, model, keys[0], grace_s)
        return _unload(worker, consumer, model, keys, grace_s)
    except Exception as exc:  # noqa: BLE001 - answered, not raised into Celery's consumer
        log.exception("unload of %s failed", what)
        return _refusal(worker, model, f"unload of {what} failed: {type(exc).__name__}: {exc}")
    finally:
        worker.leaving.difference_update(keys)


def _unload(worker: Worker, consumer: Any, model: str, keys: list[str],
            grace_s: float) -> dict[str, Any]:
    """Every version of ``model`` leaves: its queue is left and what waits given back."""
    runtime = worker.runtime
    _withdraw(worker, model)
    if not consumer.set_queues([q for q in consumer.queues if model_from_queue(q) != model]):
        raise RuntimeError("the consumer did not leave the queue in time (it stops?)")
    worker.fast_queues = list(consumer.queues)
    given_back = consumer.give_back(model)
    left = _finish(lambda: consumer.held_of(model), model, grace_s)
    for key in keys:
        runtime.unhost(key)
        runtime.unload(key)
    _withdraw(worker, model)  # again: an announcement may have been on its way meanwhile
    log.info("model %s unloaded (model control): %d requests given back to its queue", model,
             given_back)
    reply = {"ok": True, "model": model, "given_back": given_back, **_where(worker)}
    if left:
        reply["unfinished"] = left
    return reply


def _unload_version(worker: Worker, consumer: Any, model: str, key: str,
                    grace_s: float) -> dict[str, Any]:
    """One version of ``model`` leaves, others stay: the queue is still taken, so nothing is
    given back (it would come back here); requests for it are no longer routed to it (a request
    naming it is refused from now on, one naming no version runs on the latest left), and those
    it has run to their end."""
    runtime = worker.runtime
    version = runtime.by_model()[key].model.version
    runtime.unhost(key)
    worker.announce_now()  # the catalogue's versions without it (it is leaving)
    # a trip through the consumer thread: what it was starting is handed to a runner now; what
    # it starts from now on does not go to this version
    consumer.set_queues(consumer.queues)
    started = consumer.started_of(model)  # this version's among them, the others' too
    left = _finish(lambda: consumer.still_held(started), f"{model} version {version}", grace_s)
    runtime.unload(key)
    log.info("model %s version %s unloaded (model control); its other versions serve", model,
             version)
    reply = {"ok": True, "model": model, "version": version, "given_back": 0, **_where(worker)}
    if left:
        reply["unfinished"] = left
    return reply


def _withdraw(worker: Worker, model: str) -> None:
    try:
        worker.withdraw_model(model)
    except redis.RedisError as exc:
        log.warning("model catalogue: withdrawal of %s failed (%s); it lapses within the TTL",
                    model, exc)


def _finish(held: Callable[[], int], what: str, grace_s: float) -> int:
    """Wait up to ``grace_s`` until ``held()`` is 0 (what is on the device answered); how many
    still are."""
    deadline = time.monotonic() + grace_s
    while (left := held()) and time.monotonic() < deadline:
        time.sleep(0.02)
    if left:
        log.warning("unload of %s: %d requests still running after %.0f s fail as the model stops",
                    what, left, grace_s)
    return left


def _worker(state: Any) -> Worker:
    return getattr(state.consumer.controller, "asyncinfer", None) or worker_of(state.consumer.app)


def repository(worker: Worker) -> dict[str, Any]:
    """What this worker could load (its registry, the model folder read again), what it has
    loaded, and those whose load failed here with why ({} for a worker that is no device
    worker)."""
    if not worker.has_runtime():
        return {}
    runtime = worker.runtime
    return {"device": runtime.device.label, "models": runtime.models,
            "loadable": runtime.loadable(), "failed": dict(runtime.failed)}


@inspect_command()  # type: ignore[misc]
def asyncinfer_repository(state: Any, **_: Any) -> dict[str, Any]:
    """Models this worker could load and those it has loaded (the repository index)."""
    return repository(_worker(state))


@control_command(args=[("model", str), ("version", str), ("factory", str)],  # type: ignore[misc]
                 signature="<model> [version] [factory]")
def asyncinfer_load_model(state: Any, model: str = "", version: str = "", factory: str = "",
                          **_: Any) -> dict[str, Any]:
    """Load a model on this worker's device and take its requests (model control); a factory
    named is imported only from a module ASYNCINFER_LOADABLE_FACTORIES allows."""
    worker = _worker(state)
    if not model:
        return _refusal(worker, model, "no model named")
    return load_model(worker, str(model), str(version or ""), str(factory or ""))


@control_command(args=[("model", str), ("grace_s", float), ("version", str)],  # type: ignore[misc]
                 signature="<model> [grace_s] [version]")
def asyncinfer_unload_model(state: Any, model: str = "", grace_s: float = STOP_GRACE_S,
                            version: str = "", **_: Any) -> dict[str, Any]:
    """Unload a model from this worker: give back its queued requests, finish those running."""
    worker = _worker(state)
    if not model:
        return _refusal(worker, model, "no model named")
    return unload_model(worker, str(model), float(grace_s), str(version or ""))
