"""``asyncinfer worker``: one Celery worker process bound to one device.

The device's visible-device variable is set before anything touches the device, the settings go
to the environment the Celery app is built from, then Celery's own worker runs with the threads
pool (the device is never initialised in a process that forks).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from asyncinfer.config.settings import Settings
from asyncinfer.constants import queue_for
from asyncinfer.engine.device import bind_visible_device, parse_device
from asyncinfer.models.registry import Registry

__all__ = ["run_worker", "worker_hostname", "uses_fast_consumer", "CONTROL_QUEUE"]

#: What Celery's own consumer listens on in a worker whose fast consumer takes the infer.* queues.
CONTROL_QUEUE = "asyncinfer.control"


def worker_hostname(device: str) -> str:
    """Celery node name of the worker for ``device``: ``cuda1@host``, ``cpu@host``."""
    return f"{device.replace(':', '')}@{socket.gethostname()}"


def run_worker(device: str = "auto", models: Sequence[str] = (), *, concurrency: int | None = None,
               loglevel: str | None = None, hostname: str | None = None,
               extra_args: Sequence[str] = ()) -> None:
    """Run a device worker in this process until it is stopped (SIGTERM or Ctrl-C)."""
    spec = parse_device(device)
    os.environ["ASYNCINFER_DEVICE_LABEL"] = str(spec) if spec.type != "auto" else ""
    local = bind_visible_device(spec)
    os.environ["ASYNCINFER_DEVICE"] = str(local)
    if models:
        os.environ["ASYNCINFER_MODELS"] = ",".join(models)
    if concurrency:
        os.environ["ASYNCINFER_CONCURRENCY"] = str(concurrency)

    settings = Settings.from_env()
    hosted = list(settings.models) or Registry.from_config(
        settings.model_factories, settings.model_dir).names()
    os.environ["ASYNCINFER_MODELS"] = ",".join(hosted)

    from asyncinfer.celery_app import app  # built now, from the environment set above

    queues = [queue_for(m) for m in hosted]
    threads = settings.concurrency
    if uses_fast_consumer(settings, app.conf.broker_url):
        from asyncinfer.worker.intake.fast_consumer import FastConsumerStep

        # The fast consumer takes the infer.* queues; Celery's consumer must consume some queue,
        # and serves remote control (status, revoke, ping) and the events.
        app.asyncinfer_fast_queues = queues
        app.steps["worker"].add(FastConsumerStep)
        queues, threads = [CONTROL_QUEUE], 2
    argv = ["worker", "-P", "threads", "-c", str(threads), "-Q", ",".join(queues),
            "-n", hostname or worker_hostname(str(spec)),
            "-l", (loglevel or settings.log_level).upper(), *extra_args]
    app.worker_main(argv)


def uses_fast_consumer(settings: Settings, broker_url: str) -> bool:
    """Whether ``asyncinfer worker`` runs the fast consumer (configured, and a Redis broker)."""
    from asyncinfer.connections import is_redis_url

    return settings.consumer == "fast" and is_redis_url(broker_url)
