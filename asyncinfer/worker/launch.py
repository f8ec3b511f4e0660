"""``asyncinfer worker``: one Celery worker process bound to one device.

The device's visible-device variable is set before anything touches the device, the settings are
given to the Celery app explicitly, then Celery's own worker runs with the threads pool (the device
is never initialised in a process that forks).
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Sequence
from typing import Any

from asyncinfer.config.settings import Settings
from asyncinfer.constants import queue_for
from asyncinfer.engine.device import bind_visible_device, parse_device
from asyncinfer.models.registry import Registry
from asyncinfer.worker.intake.step import uses_fast_consumer
from asyncinfer.worker.runtime import set_device_label

__all__ = ["run_worker", "worker_hostname", "uses_fast_consumer"]



def worker_hostname(device: str) -> str:
    """Celery node name of the worker for ``device``: ``cuda1@host``, ``cpu@host``."""
    return f"{device.replace(':', '')}@{socket.gethostname()}"


def run_worker(device: str = "auto", models: Sequence[str] = (), *, concurrency: int | None = None,
               loglevel: str | None = None, hostname: str | None = None,
               extra_args: Sequence[str] = (), **overrides: Any) -> None:
    """Run a device worker in this process until it is stopped (SIGTERM or Ctrl-C).

    Its settings are the ``ASYNCINFER_*`` environment's with these arguments (and any other
    setting in ``overrides``, e.g. ``broker_url``) in their place, given to the app explicitly.
    """
    spec = parse_device(device)
    local = bind_visible_device(spec)  # before anything touches the device
    given: dict[str, Any] = {"device": str(local), **overrides}
    if models:
        given["models"] = tuple(models)
    if concurrency:
        given["concurrency"] = concurrency
    settings = Settings.from_env(**given)
    hosted = list(settings.models) or Registry.from_config(
        settings.model_factories, settings.model_dir).names()
    settings = dataclasses.replace(settings, models=tuple(hosted))
    set_device_label(str(spec) if spec.type != "auto" else None)

    from asyncinfer.celery_app import app, configure

    configure(app, settings)
    queues = [queue_for(m) for m in hosted]
    # With the fast consumer (worker/intake/step.py) Celery's pool runs no inference: two
    # threads serve remote control.
    threads = 2 if uses_fast_consumer(settings, app.conf.broker_url) else settings.concurrency
    argv = ["worker", "-P", "threads", "-c", str(threads), "-Q", ",".join(queues),
            "-n", hostname or worker_hostname(str(spec)),
            "-l", (loglevel or settings.log_level).upper(), *extra_args]
    app.worker_main(argv)
