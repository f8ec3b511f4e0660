"""A device worker's device, its models and their runners.

Made inside the worker process (never in a parent that forks), once, by its
:class:`~asyncinfer.worker.worker.Worker`.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from asyncinfer.config.settings import Settings
from asyncinfer.engine.completion import Completed, settle
from asyncinfer.engine.device import Device, bind_visible_device, parse_device
from asyncinfer.engine.freeing import free_memory
from asyncinfer.engine.hooks import DeviceHooks
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.engine.threads import apply_intra_op_threads
from asyncinfer.engine.timer import TimeLimits, Timer
from asyncinfer.errors import UnknownModel
from asyncinfer.models.registry import Registry
from asyncinfer.policy.expiry import is_revoked
from asyncinfer.policy.retries import is_transient
from asyncinfer.policy.time_limits import Wedge
from asyncinfer.store.tensor_store import store_from_settings
from asyncinfer.wire.model_versions import (
    PARAMETER,
    sorted_versions,
    split_key,
    version_key,
)
from asyncinfer.wire.protocol import Request, decode_request
from asyncinfer.wire.triton_words import unknown_model
from asyncinfer.worker.cache_generations import CacheGenerations
from asyncinfer.worker.celery_errors import as_celery
from asyncinfer.worker.metrics import WorkerMetrics
from asyncinfer.worker.model_routes import Routes, answering, route, routes_of
from asyncinfer.worker.tensor_refs import encoded_outputs, inputs_read

__all__ = ["WorkerRuntime", "PartCallback", "LoadFailed"]

#: Where a decoupled model's request's parts go: ``(index, v2 output tensors)``.
PartCallback = Callable[[int, list[Any]], None]

log = logging.getLogger(__name__)


class LoadFailed(Exception):
    """Model ``model`` failed to load at start: ``cause`` is what its loading raised (``text``:
    the message, when not ``loading MODEL failed: Type: cause``)."""

    def __init__(self, model: str, cause: BaseException, text: str = "") -> None:
        super().__init__(text or f"loading {model} failed: {type(cause).__name__}: {cause}")
        self.model = model
        self.cause = cause


class WorkerRuntime:
    """One device and the models this process serves on it.

    ``device_label``: the device as the user named it (``cuda:1``), for reporting (None: as the
    runtime names it); ``metrics``: where each device batch is recorded; ``cache_generations``:
    where each change of routes is told which weights answer each model now, for the response
    cache (worker/cache_generations.py; None: no answer of this runtime's is cached).
    """

    def __init__(self, settings: Settings, *, device_label: str | None = None,
                 metrics: WorkerMetrics | None = None,
                 cache_generations: CacheGenerations | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or WorkerMetrics()
        self.cache_generations = cache_generations
        #: Runner key → (its runner, the token of the weights it loaded) for the response cache.
        self._weights: dict[str, tuple[ModelRunner, str]] = {}
        spec = parse_device(settings.device)
        label = device_label
        if label is None and spec.type != "auto":
            label = str(spec)
        self.device = Device(bind_visible_device(spec), label=label)
        self.registry = Registry.from_config(settings.model_factories, settings.model_dir)
        #: Where tensors too large for a message go (None: none; worker/tensor_refs.py).
        self.tensor_store = store_from_settings(settings)
        self._runners: dict[str, ModelRunner] = {}
        #: Models whose load failed here, and why (``Type: message``), until a load succeeds.
        self.failed: dict[str, str] = {}
        #: What this worker hosts, once a load or unload told it (None: ``settings.models``).
        self._hosted: list[str] | None = None
        #: Model → its hosted runners' (key, version), the latest last (how requests route).
        self._routes: Routes = {}
        self._lock = threading.Lock()
        #: Time limits and delayed retries.
        self.timer = Timer()
        #: What the runners tell whoever serves the requests (:meth:`use`); until a consumer
        #: does (a call in this process: ``infer.apply()``), a wedged device fails the request
        #: and the process leaves.
        self.hooks = DeviceHooks(on_wedged=Wedge(lambda item, exc: settle(item.future, exc=exc),
                                                 exit_after_s=2.0))

    def use(self, hooks: DeviceHooks) -> None:
        """From now on the runners tell ``hooks`` (the fast consumer's, while it serves)."""
        self.hooks = hooks

    def load(self, models: Iterable[str], optional: Iterable[str] = ()) -> None:
        """Load ``models`` now (a worker does this at start), with torch's intra-op pool sized for
        the most instances any of them runs at once (:mod:`asyncinfer.engine.threads`).

        A model of ``optional`` that fails to load is left out: what it allocated is freed, the
        reason is logged once and kept in :attr:`failed` (a request for it is refused with it),
        and the others load. Any other model's failure raises :class:`LoadFailed` naming it.
        """
        lenient = set(optional)
        with self._lock:
            built: dict[str, ModelRunner] = {}
            for name in dict.fromkeys(models):
                if name not in self._runners:
                    try:
                        built[name] = self._build(name)
                    except Exception as exc:  # noqa: BLE001 - raised again, or recorded
                        self._load_failed(name, exc, lenient)
            instances = max((r.options.instances for r in built.values()), default=1)
            apply_intra_op_threads(self.settings.intra_op_threads, instances,
                                   on_cpu=not self.device.is_accelerator)
            for name in list(built):
                runner = built.pop(name)
                try:
                    self._start(name, runner)
                except Exception as exc:  # noqa: BLE001 - raised again, or recorded
                    runner.close()
                    del runner  # before its memory is freed
                    self._load_failed(name, exc, lenient)

    def _load_failed(self, name: str, exc: Exception, lenient: set[str]) -> None:
        """(Under the lock.) Free what loading ``name`` allocated; for a model of ``lenient``,
        record and log why, else raise :class:`LoadFailed`."""
        traceback.clear_frames(exc.__traceback__)  # its frames hold the half-loaded model
        free_memory(self.device)
        if name not in lenient:
            raise LoadFailed(name, exc) from exc
        self.failed[name] = f"{type(exc).__name__}: {exc}"
        log.warning("model %s failed to load on %s and is not served: %s", name,
                    self.device.label, self.failed[name])

    def runner(self, model: str, request_id: str | None = None, version: str = "") -> ModelRunner:
        """The runner of ``model`` (of its ``version``, else of the latest version hosted here),
        loading it on first use; UnknownModel if not registered, not hosted here, or not that
        version."""
        return self._resolve(model, request_id, version)[1]

    def _resolve(self, model: str, request_id: str | None,
                 version: str) -> tuple[str, ModelRunner]:
        key = self._route(model, version, request_id)
        runner = self._runners.get(key)
        if runner is not None:
            return key, runner
        reason = self.failed.get(key)
        if reason is not None:
            who = f" (request {request_id})" if request_id else ""
            raise UnknownModel(f"{unknown_model(model)}{who}: model '{model}' failed to load on "
                               f"this worker: {reason}")
        hosted = self.settings.models if self._hosted is None else self._hosted
        if (hosted or self._hosted is not None) and model not in hosted \
                and model in self.registry.names():
            who = f" (request {request_id})" if request_id else ""
            raise UnknownModel(f"{unknown_model(model)}{who}: model '{model}' is not hosted by this "
                               f"worker (it hosts: {', '.join(hosted) or 'none'})")
        with self._lock:
            runner = self._runners.get(model)
            if runner is None:
                runner = self._start(model, self._build(model, request_id))
        if version and runner.model.version != version:
            raise self._no_version(model, version, request_id)
        return model, runner

    def _route(self, model: str, version: str, request_id: str | None) -> str:
        """The key of the runner a request for ``model`` (``version``) goes to
        (worker/model_routes.py)."""
        key = route(self._routes, model, version)
        if key is None:
            raise self._no_version(model, version, request_id)
        return key

    def _reroute(self) -> None:
        """(Under the lock, after a load, unhost or unload.) The routes of the runners hosted."""
        routes = routes_of(self._runners, self._hosted)
        generations = self.cache_generations
        if generations is None:
            self._routes = routes
            return
        with generations.changing(answering(routes, self._token_of)):  # recorded before they route
            self._routes = routes

    def _token_of(self, key: str) -> str:
        """(Under the lock.) The token of the weights of the runner loaded as ``key`` ("" for
        none: not cached)."""
        weights = self._weights.get(key)
        return weights[1] if weights is not None and weights[0] is self._runners.get(key) else ""

    def _no_version(self, model: str, version: str, request_id: str | None) -> UnknownModel:
        who = f" (request {request_id})" if request_id else ""
        loaded = sorted_versions(r.model.version for key, r in self._runners.items()
                                 if split_key(key)[0] == model)
        return UnknownModel(f"{unknown_model(model, version)}{who}: not on this worker (versions "
                            f"here: {', '.join(loaded) or 'none'})")

    def key_for(self, model: str, version: str = "") -> str:
        """The registry name of ``version`` of ``model`` (``model@version``, or ``model`` itself
        for its own version, "1" unless it declares another); UnknownModel if none."""
        if not version:
            return model
        key = version_key(model, version)
        if key in self.registry.names() or key in self._rescan():  # or a file added since
            return key
        running = self._runners.get(model)
        own = running.model.version if running is not None else (
            self.registry.version_of(model) or "1")
        if version == own and model in self.registry.names():
            return model
        raise UnknownModel(f"model '{model}' has no version '{version}' registered (register it "
                           f"as '{key}': a factory entry {key}=pkg.mod:factory, or a file "
                           f"{key}.pt in the model folder)")

    def versions_of(self, model: str) -> dict[str, str]:
        """The loaded runners of ``model``: key → version."""
        return {key: r.model.version for key, r in list(self._runners.items())
                if split_key(key)[0] == model}

    def _build(self, model: str, request_id: str | None = None) -> ModelRunner:
        instance = self.registry.create(model, request_id)
        name, version = split_key(model)
        if version:  # version v of m, registered as m@v
            instance.name, instance.version = name, version
        options = self.settings.options_for(model, instance.options)
        return ModelRunner(instance, self.device, options, is_revoked=is_revoked, timer=self.timer,
                           is_transient=is_transient, on_batch=self.metrics.record_batch,
                           hooks=lambda: self.hooks,  # whoever serves its requests, now
                           record_batches=self.settings.tracing != "off",
                           hang_after_s=self.settings.hang_after_s or None)

    def _start(self, model: str, runner: ModelRunner) -> ModelRunner:
        generations = self.cache_generations
        if generations is None or not generations.caches(split_key(model)[0]):
            runner.start()
        else:
            before = generations.before_load(runner.model)
            runner.start()
            self._weights[model] = (runner, generations.token(runner.model, before))
        log.info("model %s loaded on %s", model, self.device.label)
        self._runners[model] = runner
        self._reroute()
        return runner

    def load_one(self, model: str) -> bool:
        """Load ``model`` on the device now and host it (a model control load); False when it
        was loaded already. A file added to the model folder since the worker started is found.

        Raises:
            UnknownModel: not registered (nor a file of the model folder).
            Exception: whatever the loading raised (a file that fails the loading rules: ValueError;
                out of device memory); what it had allocated is freed, the worker serves on.
        """
        with self._lock:
            if model in self._runners:
                self._host(model)
                return False
            if model not in self.registry.names():
                self._rescan()  # a file added since
            runner: ModelRunner | None = None
            try:
                runner = self._build(model)
                self._start(model, runner)
            except Exception as exc:
                if runner is not None:
                    runner.close()
                runner = None
                # the traceback's frames hold the half-loaded model (``self`` of its load):
                # cleared, so that its memory is given back now, not when the error is dropped
                traceback.clear_frames(exc.__traceback__)
                free_memory(self.device)
                raise
            self.failed.pop(model, None)
            self._host(model)
            return True

    def loadable(self) -> list[str]:
        """Every model this worker could load: registered, or in the model folder now."""
        return self._rescan()

    def _rescan(self) -> list[str]:
        """The registered names, once the model folder is read again (what was added since
        registers, under the keys the registry keeps stable: Registry.add_dir)."""
        folder = Path(self.settings.model_dir) if self.settings.model_dir else None
        if folder is not None and folder.is_dir():
            self.registry.add_dir(folder)
        return self.registry.names()

    def _host(self, model: str) -> None:
        hosted = list(self.settings.models if self._hosted is None else self._hosted)
        self._hosted = hosted + [model] if model not in hosted else hosted
        self._reroute()

    def unhost(self, model: str) -> None:
        """Host ``model`` no more: a request for it is refused from now on (its runner stays until
        :meth:`unload`)."""
        with self._lock:
            hosted = self.settings.models if self._hosted is None else self._hosted
            self._hosted = [m for m in hosted if m != model]
            self._reroute()

    def unload(self, model: str) -> bool:
        """Stop ``model``'s runner (what still waits in its batcher fails: withdraw it first) and
        free its memory; False when it was not loaded."""
        with self._lock:
            runner = self._runners.pop(model, None)
            self._weights.pop(model, None)
            self._reroute()
        if runner is None:
            return False
        runner.close()
        del runner
        free_memory(self.device)
        log.info("model %s unloaded from %s", model, self.device.label)
        return True

    def runners(self) -> list[ModelRunner]:
        """The runners loaded so far."""
        return list(self._runners.values())

    def by_model(self) -> dict[str, ModelRunner]:
        """The runners loaded so far, by model name."""
        return dict(self._runners)

    @property
    def models(self) -> list[str]:
        """Models loaded in this process."""
        return sorted(self._runners)

    def pending(self) -> dict[str, int]:
        """Requests waiting for the device, per model."""
        return {name: len(runner.batcher) for name, runner in self._runners.items()}

    def waiting_ids(self) -> set[str]:
        """IDs of the requests waiting in the batchers (handed to a model, not yet on its device)."""
        return set().union(*(runner.batcher.waiting_ids() for runner in self.runners()))

    def withdraw(self, request_ids: set[str]) -> set[str]:
        """Take the requests of ``request_ids`` that still wait in a batcher out of it; the IDs
        withdrawn (those already on the device run)."""
        return {item.request.id for runner in self.runners()
                for item in runner.batcher.withdraw(request_ids)}

    def submit(self, request_id: str, kwargs: Any, *, received_at: float | None = None,
               expires_in_s: float | None = None,
               time_limits: TimeLimits | None = None,
               alone: bool = False, suspect: bool = False, priority: int = 0,
               trace: Any = None,
               streaming: Callable[[int], PartCallback] | None = None,
               ) -> tuple[Request, Future[Completed]]:
        """Decode and validate one request and queue it for the device (``alone``: in a batch of
        its own; ``suspect``: in a batch of suspects; ``priority``: Celery's, 0 first; ``trace``:
        its trace tag, handed back in its batch's record when tracing); InvalidRequest if bad.
        For a decoupled model, ``streaming(stream_max_parts)`` is called first (before the
        request is decoded) and gives where its parts go."""
        model = kwargs.get("model") if isinstance(kwargs, Mapping) else None
        if not isinstance(model, str):
            decode_request(request_id, kwargs)  # raises the error that names what is wrong
            raise AssertionError("unreachable")
        key, runner = self._resolve(model, request_id, _version_in(kwargs))
        kwargs = inputs_read(request_id, kwargs, self.tensor_store)  # before a batch waits on it
        on_part = (streaming(runner.options.stream_max_parts)
                   if streaming is not None and runner.model.decoupled else None)
        with runner.batcher.arriving():  # a forming batch may wait for this request
            request = decode_request(request_id, kwargs)
            if key != model or PARAMETER in request.parameters:  # versions: say which ran it
                request.parameters[PARAMETER] = runner.model.version
            return request, runner.submit(request, received_at=received_at,
                                          expires_in_s=expires_in_s, time_limits=time_limits,
                                          alone=alone, suspect=suspect, priority=priority,
                                          trace=trace,
                                          on_part=on_part)

    def infer(self, request_id: str, kwargs: Mapping[str, Any], worker: str,
              expires_in_s: float | None = None,
              time_limits: TimeLimits | None = None, priority: int = 0) -> dict[str, Any]:
        """Decode, validate and run one request (batched with others); return its v2 response."""
        request, future = self.submit(request_id, kwargs, expires_in_s=expires_in_s,
                                      time_limits=time_limits, priority=priority)
        exc = future.exception()
        if exc is not None:
            raise as_celery(exc)
        return self.response(request, future.result(), worker)

    def response(self, request: Request, done: Completed, worker: str) -> dict[str, Any]:
        """The v2 response of a request the device finished."""
        return {
            "model_name": request.model,
            "id": request.id,
            "outputs": encoded_outputs(request, done.outputs, self.tensor_store,
                                       self.settings.tensor_ref_bytes),
            "parameters": {
                "worker": worker,
                "device": self.device.label,
                "batch_size": done.batch_size,
                "queue_ms": round(done.queue_ms, 3),
                "compute_ms": round(done.compute_ms, 3),
                **({PARAMETER: request.parameters[PARAMETER]}
                   if PARAMETER in request.parameters else {}),
            },
        }

    def close(self) -> None:
        """Stop every runner."""
        with self._lock:
            runners, self._runners = list(self._runners.values()), {}
            self._routes = {}
        for runner in runners:
            runner.close()
        self.timer.close()


def _version_in(kwargs: Mapping[str, Any]) -> str:
    """The version a request's parameters name ("" for none)."""
    parameters = kwargs.get("parameters")
    value = parameters.get(PARAMETER) if isinstance(parameters, Mapping) else None
    return str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) and \
        str(value) else ""
