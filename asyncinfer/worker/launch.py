"""``asyncinfer worker``: one Celery worker process bound to one device.

The device's visible-device variable is set before anything touches the device, the settings are
given to the Celery app explicitly, then Celery's own worker runs with the threads pool (the device
is never initialised in a process that forks).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence
from typing import Any

from asyncinfer.config.settings import Settings
from asyncinfer.constants import queue_for
from asyncinfer.engine.device import VISIBLE_DEVICE_VARS, DeviceSpec, bind_visible_device, parse_device
from asyncinfer.errors import AsyncInferError
from asyncinfer.models.registry import Registry, import_from_working_dir
from asyncinfer.wire.model_versions import split_key
from asyncinfer.worker.step import uses_fast_consumer

__all__ = ["run_worker", "worker_hostname", "check_device", "check_models", "WorkerCannotStart"]

_SUPPORTED = "auto, cpu, cuda:N, npu:N"


class WorkerCannotStart(AsyncInferError):
    """A worker cannot start as configured (no such device, an unregistered model); the message
    names the cause and what to do."""


def check_device(spec: DeviceSpec, local: DeviceSpec | None = None) -> None:
    """Raise :class:`WorkerCannotStart` unless this host has ``spec``; ``local`` is its name after
    :func:`~asyncinfer.engine.device.bind_visible_device`. Counts devices, initialises none."""
    local = local or spec
    if spec.type in ("cpu", "auto"):
        return
    if spec.type == "npu":
        try:
            import torch_npu  # noqa: F401 - registers the npu device type with torch
        except ImportError:
            raise WorkerCannotStart(
                f"device {spec}: needs torch_npu, which is not installed; on a host with Ascend's "
                f"CANN toolkit (its set_env.sh sourced), pip install 'asyncinfer[npu]' (the npu "
                f"extra), or choose --device cpu") from None
    import torch

    if spec.type == "cuda" and torch.version.cuda is None:
        raise WorkerCannotStart(f"device {spec}: this torch ({torch.__version__}) is built without "
                                f"CUDA; install a CUDA build of torch, or choose --device cpu")
    if spec.type in ("cuda", "npu"):
        module = getattr(torch, spec.type)
        count = int(module.device_count()) if module.is_available() else 0
    else:
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if acc is None or acc.type != spec.type:
            raise WorkerCannotStart(f"device {spec}: {spec.type!r} devices are not supported "
                                    f"(devices: {_SUPPORTED})")
        count = int(torch.accelerator.device_count())
    if (local.index or 0) >= count:
        var = VISIBLE_DEVICE_VARS.get(spec.type, "")
        seen = f"{var}={os.environ[var]}: " if os.environ.get(var) else ""
        raise WorkerCannotStart(f"device {spec}: no such {spec.type} device on this host ({seen}"
                                f"torch sees {count}; is the driver loaded?); choose another "
                                f"--device (devices: {_SUPPORTED})")


def check_models(hosted: Sequence[str], registry: Registry) -> None:
    """Raise :class:`WorkerCannotStart` naming each model of ``hosted`` not in ``registry``."""
    known = registry.names()
    unknown = [m for m in hosted if m not in known]
    if unknown:
        raise WorkerCannotStart(
            f"model(s) {', '.join(unknown)} not registered (registered: {', '.join(known)}; "
            f"register others with ASYNCINFER_MODEL_FACTORIES or ASYNCINFER_MODEL_DIR)")


def worker_hostname(device: str) -> str:
    """Celery node name of the worker for ``device``: ``cuda1@host``, ``cpu@host``."""
    return f"{device.replace(':', '')}@{socket.gethostname()}"


def run_worker(device: str = "auto", models: Sequence[str] = (), *, concurrency: int | None = None,
               loglevel: str | None = None, hostname: str | None = None,
               extra_args: Sequence[str] = (), **overrides: Any) -> int:
    """Run a device worker in this process until it is stopped (SIGTERM or Ctrl-C); return its
    exit status. Raises :class:`WorkerCannotStart` (before Celery starts) naming the cause when
    the device is not there, a model is not registered or a factory cannot be imported (the
    working directory is on the import path, as under ``asyncinfer up``).

    Its settings are the ``ASYNCINFER_*`` environment's with these arguments (and any other
    setting in ``overrides``, e.g. ``broker_url``) in their place, given to the app explicitly.
    """
    try:
        spec = parse_device(device)
    except ValueError as exc:
        raise WorkerCannotStart(str(exc)) from None
    local = bind_visible_device(spec)  # before anything touches the device
    check_device(spec, local)
    given: dict[str, Any] = {"device": str(local), **overrides}
    if models:
        given["models"] = tuple(models)
    if concurrency:
        given["concurrency"] = concurrency
    settings = Settings.from_env(**given)
    import_from_working_dir()  # a factory's module beside the command imports, as under `up`
    try:
        registry = Registry.from_config(settings.model_factories, settings.model_dir)
    except ValueError as exc:  # a factory that cannot be imported, a model folder that is none
        raise WorkerCannotStart(str(exc)) from None
    named = tuple(settings.models)  # --models or ASYNCINFER_MODELS: each must load
    hosted = list(named) or registry.served()
    check_models(hosted, registry)
    try:  # with a routing table: the one broker of its models
        settings = dataclasses.replace(settings, models=tuple(hosted)).for_models(hosted)
    except ValueError as exc:
        raise WorkerCannotStart(str(exc)) from None

    from asyncinfer.celery_app import app, configure
    from asyncinfer.worker.worker import Worker, attach

    configure(app, settings)
    # The one object of this device worker (Celery's worker_init names it: bootstrap.py).
    # Models named must load or the worker does not start; of the default set (every registered
    # model), one that fails is left out, and the worker serves the others.
    attach(app, Worker(app, settings, device_label=str(spec) if spec.type != "auto" else None,
                       required=named))
    # every version of a model (m@v) comes by the model's one queue
    queues = list(dict.fromkeys(queue_for(split_key(m)[0]) for m in hosted))
    # With the fast consumer (worker/step.py) Celery's pool runs no inference: two
    # threads serve remote control.
    threads = 2 if uses_fast_consumer(settings, app.conf.broker_url) else settings.concurrency
    argv = ["worker", "-P", "threads", "-c", str(threads), "-Q", ",".join(queues),
            "-n", hostname or worker_hostname(str(spec)),
            "-l", (loglevel or settings.log_level).upper(), *extra_args]
    return _celery_worker(app, argv)


def _celery_worker(app: Any, argv: list[str]) -> int:
    """Run ``celery worker`` (what ``app.worker_main`` runs) and return its exit status, which
    ``worker_main`` drops: an "Unrecoverable error" (no broker at start, say) is 1, not 0."""
    from celery.bin.celery import celery
    from click.exceptions import Exit

    celery.params[0].default = app  # what app.start() does: the --app option's default
    try:
        code = celery.main(args=argv, standalone_mode=False)
    except Exit as exc:
        code = exc.exit_code
    finally:
        celery.params[0].default = None
    return code if isinstance(code, int) else 0
