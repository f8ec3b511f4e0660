"""One device worker, as one object: its name, settings, policy, device runtime, metrics, its entry
in the model catalogue, what feeds its pipeline, and what Celery's inspection asks of it.

Built once per worker: by ``asyncinfer worker`` (:func:`~asyncinfer.worker.launch.run_worker`),
or, under ``celery -A asyncinfer worker``, when Celery's ``worker_init`` finds none
(bootstrap.py). It is kept on the Celery app (``app.asyncinfer_worker``) and on Celery's worker
(``controller.asyncinfer``), where Celery's signals, its remote-control commands and Celery's
consumer find it; everything else is given it. Nothing of a worker lives in module state, so two
workers can live in one process (each with its own runtime, metrics and registry).

The device runtime is made on first use, inside the process that owns the device (a worker whose
pool forks runs no model: worker/step.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch
from celery import Celery

from asyncinfer.config.bound import settings_of
from asyncinfer.config.settings import Settings
from asyncinfer.constants import model_from_queue
from asyncinfer.models.base import Model
from asyncinfer.models.registry import Registry
from asyncinfer.policy.policy import Policy
from asyncinfer.tracing import tracing_for
from asyncinfer.wire.model_versions import sorted_versions, split_key
from asyncinfer.worker.announcer import Announcer, announcer_for
from asyncinfer.worker.cache_generations import generations_of
from asyncinfer.worker.metrics import WorkerMetrics
from asyncinfer.worker.runtime import LoadFailed, WorkerRuntime
from asyncinfer.worker.stats import StatsFlusher, flusher_for
from asyncinfer.worker.tensor_sweep import TensorSweep

if TYPE_CHECKING:
    from asyncinfer.tracing.spans import Tracing
    from asyncinfer.worker.consumers.consumer import PipelineConsumer

__all__ = ["Worker", "worker_of", "existing_worker", "attach"]

log = logging.getLogger(__name__)

#: Guards the making of an app's worker where Celery's ``worker_init`` did not make one (a task
#: run in a process that is no worker).
_making = threading.Lock()

_ATTRIBUTE = "asyncinfer_worker"


class Worker:
    """A device worker of ``app`` under ``settings``, named ``name`` (Celery's node name).

    ``device_label``: the device as the user named it (``cuda:1``), for reporting; after the
    visible-device variable is set, the process sees that device as ``cuda:0``. ``required``:
    the models that must load at start or the worker does not start (None: every model it
    hosts); any other that fails is left out, and the worker serves the rest.
    """

    def __init__(self, app: Celery, settings: Settings, name: str = "", *,
                 device_label: str | None = None,
                 required: Collection[str] | None = None) -> None:
        self.app = app
        self.settings = settings
        self.required = required
        self.name = name or f"{os.getpid()}@{socket.gethostname()}"
        self.device_label = device_label
        self.metrics = WorkerMetrics()
        #: The ``infer.*`` queues its fast consumer takes (empty: none runs).
        self.fast_queues: list[str] = []
        #: What feeds its pipeline, once it runs: the fast consumer, or the kombu intake.
        self.consumer: PipelineConsumer | None = None
        self.announcer: Announcer | None = None
        #: Adds the worker's counts to the fleet statistics in Redis (from its first announcement).
        self.stats_flusher: StatsFlusher | None = None
        #: Removes the tensor store's expired objects (worker/tensor_sweep.py; None: no store).
        self.tensor_sweep: TensorSweep | None = None
        self._runtime: WorkerRuntime | None = None
        #: Models being unloaded (worker/model_control.py): no longer announced.
        self.leaving: set[str] = set()
        #: Versions a load command registered from the factory it named (``m@2`` → ``mod:make_v2``;
        #: worker/factory_loads.py).
        self.command_factories: dict[str, str] = {}
        self._policy: Policy | None = None
        #: Models loaded on the CPU for the preprocess and postprocess stages (tasks/stages.py).
        self._cpu_models: dict[str, Model] = {}
        self._tracing: Tracing | None = None
        self._lock = threading.RLock()

    # -- what it is made of ----------------------------------------------------------------------

    @property
    def runtime(self) -> WorkerRuntime:
        """The device and the models on it, made on first use in this process."""
        runtime = self._runtime
        if runtime is None:
            with self._lock:
                runtime = self._runtime
                if runtime is None:
                    runtime = self._runtime = WorkerRuntime(
                        self.settings, device_label=self.device_label, metrics=self.metrics,
                        cache_generations=generations_of(self.app))
                    self.metrics.watch(device=runtime.device.label, pending=runtime.pending)
        return runtime

    def has_runtime(self) -> bool:
        """Whether this process made its runtime already (never makes one)."""
        return self._runtime is not None

    @property
    def policy(self) -> Policy:
        """Retries and their budget, time limits, the in-flight bound, the payload limit."""
        if self._policy is None:
            with self._lock:
                if self._policy is None:
                    self._policy = Policy.of_worker(self.app, self.settings)
        return self._policy

    def cpu_model(self, name: str, request_id: str) -> Model:
        """``name``'s instance for the CPU stages in this process (loaded once, on the CPU)."""
        with self._lock:
            model = self._cpu_models.get(name)
            if model is None:
                registry = Registry.from_config(self.settings.model_factories,
                                                self.settings.model_dir)
                model = registry.create(name, request_id)
                model.load(torch.device("cpu"))
                self._cpu_models[name] = model
            return model

    def hosted_models(self) -> list[str]:
        """Models to load at start: the configured ones, else those of the consumed ``infer.*``
        queues (none for a worker that consumes no ``infer.*`` queue: the CPU stages load
        models lazily, when first asked)."""
        if self.settings.models:
            return list(self.settings.models)
        # the fast consumer's queues were Celery's until its step took them
        queues = [*self.fast_queues, *(self.app.amqp.queues.consume_from or {})]
        return list(dict.fromkeys(m for q in queues if (m := model_from_queue(q)) is not None))

    # -- its life --------------------------------------------------------------------------------

    def load(self, models: list[str]) -> None:
        """Load ``models`` on the device now, and serve metrics if asked. A worker told no models
        hosts these only: it loads no other when a request names one (UnknownModel instead).

        Raises:
            LoadFailed: a model of ``required`` failed to load, or every model did.
        """
        if models and not self.settings.models and self._runtime is None:
            self.settings = dataclasses.replace(self.settings, models=tuple(models))
        runtime = self.runtime
        required = self.required
        runtime.load(models, optional=[] if required is None else
                     [m for m in models if m not in required])
        if models and not runtime.models:
            failed = runtime.failed
            first = next(iter(failed))
            raise LoadFailed(first, RuntimeError(failed[first]), "no model loaded: " + "; ".join(
                f"loading {m} failed: {reason}" for m, reason in failed.items()))
        log.info("asyncinfer worker on %s hosts %s", runtime.device.label, ", ".join(runtime.models))
        if self.settings.metrics_port:
            self.metrics.serve(self.settings.metrics_port)

    def announce(self, name: str | None = None) -> Announcer | None:
        """Put this process's models in the model catalogue (as ``name``, default the worker's)
        until :meth:`withdraw`; returns once they are in. One that runs already is kept:
        stopping it would withdraw the entry, a gap in which the models look unserved."""
        with self._lock:
            if self.announcer is not None:
                return self.announcer
            if self._runtime is None or not self._runtime.models:
                return None
            runtime = self._runtime

            def hosted() -> list[dict[str, Any]]:
                return announced_models(runtime.by_model(), self.leaving)

            self.announcer = announcer_for(self.settings, name or self.name, runtime.device.label,
                                           hosted)
            if self.stats_flusher is None:
                self.stats_flusher = flusher_for(self.settings, name or self.name,
                                                 runtime.device.label, self.metrics.stats)
            if self.tensor_sweep is None and runtime.tensor_store is not None:
                self.tensor_sweep = TensorSweep(runtime.tensor_store).start()
            return self.announcer

    def announce_now(self) -> None:
        """Announce the models loaded now at once (after a model control load), starting the
        announcements if none ran (a worker that hosted nothing)."""
        announcer = self.announcer
        if announcer is None:
            self.announce()
        else:
            announcer.beat()

    def withdraw_model(self, model: str) -> None:
        """Take ``model`` out of this worker's catalogue entry now (an unload)."""
        announcer = self.announcer
        if announcer is not None:
            announcer.withdraw_model(model)

    def withdraw(self) -> None:
        """Take this worker's models out of the catalogue (before it gives requests back)."""
        with self._lock:
            announcer, self.announcer = self.announcer, None
        if announcer is not None:
            announcer.stop()

    def serving(self, consumer: PipelineConsumer) -> None:
        """``consumer`` now feeds this worker's pipeline."""
        self.consumer = consumer
        self.metrics.watch(in_flight=lambda: consumer.in_flight)

    def in_flight(self) -> int:
        """Requests taken and not yet answered (none feeds the pipeline yet: Celery's active
        requests, its CPU stages)."""
        if self.consumer is not None:
            return self.consumer.in_flight
        from celery.worker import state as worker_state

        return len(worker_state.active_requests)

    def info(self) -> dict[str, Any]:
        """What ``asyncinfer status`` shows of this worker."""
        runtime = self.runtime
        return {"device": runtime.device.label, "models": runtime.models, "pid": os.getpid(),
                "pending": runtime.pending(), "in_flight": self.in_flight(),
                "throughput_per_s": round(self.metrics.throughput_per_s(), 2)}

    @property
    def tracing(self) -> Tracing | None:
        """Its OpenTelemetry tracing, made at first use, when ``ASYNCINFER_TRACING`` asks for it
        (None: off, nothing imported): its consumer's spans and its CPU stages'."""
        if self.settings.tracing == "off":
            return None
        with self._lock:
            if self._tracing is None:
                self._tracing = tracing_for(self.settings)
            return self._tracing

    def close(self) -> None:
        """Withdraw, stop what feeds the pipeline (if no bootstep did), the runtime, the
        metrics server and the tracing's exporter."""
        self.withdraw()
        consumer = self.consumer
        if consumer is not None and not consumer.stopped:
            consumer.stop()
        with self._lock:
            runtime, self._runtime = self._runtime, None
        if runtime is not None:
            runtime.close()
        flusher, self.stats_flusher = self.stats_flusher, None
        if flusher is not None:  # after the runtime: the last batches are counted
            flusher.stop()
        sweep, self.tensor_sweep = self.tensor_sweep, None
        if sweep is not None:
            sweep.stop()
        self.metrics.close()
        with self._lock:
            tracing, self._tracing = self._tracing, None
        if tracing is not None:  # after the runtime: its last spans are exported
            tracing.close()


def announced_models(runners: dict[str, Any], leaving: set[str]) -> list[dict[str, Any]]:
    """The metadata a worker announces: one entry per model, its ``versions`` those loaded here
    (the latest version's inputs and outputs), none of those ``leaving`` (being unloaded)."""
    by_name: dict[str, list[Any]] = {}
    for key, runner in runners.items():
        if key not in leaving:
            by_name.setdefault(runner.model.name or split_key(key)[0], []).append(runner)
    announced = []
    for runs in by_name.values():
        versions = sorted_versions(r.model.version for r in runs)
        newest = next(r for r in runs if r.model.version == versions[-1])
        announced.append({**newest.model.metadata(newest.options), "versions": versions})
    return announced


def existing_worker(app: Celery) -> Worker | None:
    """The worker of ``app`` in this process, if one was made (never makes one)."""
    return getattr(app, _ATTRIBUTE, None)


def worker_of(app: Celery) -> Worker:
    """The worker of ``app`` in this process; made from the app's settings when there is none,
    as for a task run in a process that Celery's worker did not start."""
    worker = getattr(app, _ATTRIBUTE, None)
    if worker is not None:
        return worker
    with _making:
        worker = getattr(app, _ATTRIBUTE, None)
        if worker is None:
            worker = attach(app, Worker(app, settings_of(app) or Settings.from_env()))
    return worker


def attach(app: Celery, worker: Worker) -> Worker:
    """Make ``worker`` the worker of ``app`` in this process."""
    setattr(app, _ATTRIBUTE, worker)
    return worker
