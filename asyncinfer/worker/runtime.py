"""A device worker's device, its models and their runners.

Made inside the worker process (never in a parent that forks), once, by its
:class:`~asyncinfer.worker.worker.Worker`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

from asyncinfer.config.settings import Settings
from asyncinfer.engine.completion import Completed, settle
from asyncinfer.engine.device import Device, bind_visible_device, parse_device
from asyncinfer.engine.hooks import DeviceHooks
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.engine.threads import apply_intra_op_threads
from asyncinfer.engine.timer import Timer
from asyncinfer.errors import UnknownModel
from asyncinfer.models.registry import Registry
from asyncinfer.policy.retries import is_transient
from asyncinfer.policy.time_limits import TimeLimits, Wedge
from asyncinfer.wire.protocol import Request, decode_request, encode_tensor
from asyncinfer.worker.celery_errors import as_celery
from asyncinfer.worker.lifecycle import is_revoked
from asyncinfer.worker.metrics import WorkerMetrics

__all__ = ["WorkerRuntime", "PartCallback"]

#: Where a decoupled model's request's parts go: ``(index, v2 output tensors)``.
PartCallback = Callable[[int, list[Any]], None]

log = logging.getLogger(__name__)


class WorkerRuntime:
    """One device and the models this process serves on it.

    ``device_label``: the device as the user named it (``cuda:1``), for reporting (None: as the
    runtime names it); ``metrics``: where each device batch is recorded.
    """

    def __init__(self, settings: Settings, *, device_label: str | None = None,
                 metrics: WorkerMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or WorkerMetrics()
        spec = parse_device(settings.device)
        label = device_label
        if label is None and spec.type != "auto":
            label = str(spec)
        self.device = Device(bind_visible_device(spec), label=label)
        self.registry = Registry.from_config(settings.model_factories, settings.model_dir)
        self._runners: dict[str, ModelRunner] = {}
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

    def load(self, models: Iterable[str]) -> None:
        """Load ``models`` now (a worker does this at start), with torch's intra-op pool sized for
        the most instances any of them runs at once (:mod:`asyncinfer.engine.threads`)."""
        with self._lock:
            built = {name: self._build(name) for name in dict.fromkeys(models)
                     if name not in self._runners}
            instances = max((r.options.instances for r in built.values()), default=1)
            apply_intra_op_threads(self.settings.intra_op_threads, instances,
                                   on_cpu=not self.device.is_accelerator)
            for name, runner in built.items():
                self._start(name, runner)

    def runner(self, model: str, request_id: str | None = None) -> ModelRunner:
        """The runner of ``model``, loading it on first use; UnknownModel if not registered."""
        runner = self._runners.get(model)
        if runner is not None:
            return runner
        hosted = self.settings.models
        if hosted and model not in hosted and model in self.registry.names():
            who = f"request {request_id}: " if request_id else ""
            raise UnknownModel(f"{who}model '{model}' is not hosted by this worker "
                               f"(it hosts: {', '.join(hosted)})")
        with self._lock:
            runner = self._runners.get(model)
            if runner is None:
                runner = self._start(model, self._build(model, request_id))
        return runner

    def _build(self, model: str, request_id: str | None = None) -> ModelRunner:
        instance = self.registry.create(model, request_id)
        options = self.settings.options_for(model, instance.options)
        return ModelRunner(instance, self.device, options, is_revoked=is_revoked, timer=self.timer,
                           is_transient=is_transient, on_batch=self.metrics.record_batch,
                           hooks=lambda: self.hooks)  # whoever serves its requests, now

    def _start(self, model: str, runner: ModelRunner) -> ModelRunner:
        runner.start()
        log.info("model %s loaded on %s", model, self.device.label)
        self._runners[model] = runner
        return runner

    def runners(self) -> list[ModelRunner]:
        """The runners loaded so far."""
        return list(self._runners.values())

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
               alone: bool = False, priority: int = 0,
               streaming: Callable[[int], PartCallback] | None = None,
               ) -> tuple[Request, Future[Completed]]:
        """Decode and validate one request and queue it for the device (``alone``: in a batch of
        its own; ``priority``: Celery's, 0 first); InvalidRequest if bad. For a decoupled
        model, ``streaming(stream_max_parts)`` is called first (before the request is decoded)
        and gives where its parts go."""
        model = kwargs.get("model") if isinstance(kwargs, Mapping) else None
        if not isinstance(model, str):
            decode_request(request_id, kwargs)  # raises the error that names what is wrong
            raise AssertionError("unreachable")
        runner = self.runner(model, request_id)
        on_part = (streaming(runner.options.stream_max_parts)
                   if streaming is not None and runner.model.decoupled else None)
        with runner.batcher.arriving():  # a forming batch may wait for this request
            request = decode_request(request_id, kwargs)
            return request, runner.submit(request, received_at=received_at,
                                          expires_in_s=expires_in_s, time_limits=time_limits,
                                          alone=alone, priority=priority, on_part=on_part)

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
            "outputs": [encode_tensor(t, t.binary) for t in done.outputs],
            "parameters": {
                "worker": worker,
                "device": self.device.label,
                "batch_size": done.batch_size,
                "queue_ms": round(done.queue_ms, 3),
                "compute_ms": round(done.compute_ms, 3),
            },
        }

    def close(self) -> None:
        """Stop every runner."""
        with self._lock:
            runners, self._runners = list(self._runners.values()), {}
        for runner in runners:
            runner.close()
        self.timer.close()
