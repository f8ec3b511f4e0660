"""``asyncinfer gateway``: one process serving the v2 REST and gRPC fronts and the gateway's metrics.

Both fronts run on one asyncio loop and share one :class:`~asyncinfer.gateway.service.Service`
(one :class:`~asyncinfer.client.Client`: one set of Redis connections, one result watcher). Any
number of gateways may run on any hosts: each is stateless; the queues and results are in Redis.
SIGTERM or SIGINT stops it: the fronts stop taking calls, calls in flight get ``GRACE_S`` to end.

At start it raises its open-files limit to the hard limit and caps each front's connections below
it (open_files.py): past the cap callers are refused cleanly (connections.py), not left to time
out on a process out of descriptors; the errors that could still repeat without bound are logged
once an interval with a count (repeated_logs.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

from asyncinfer import __version__
from asyncinfer.client.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.gateway.grpc_api import start_grpc
from asyncinfer.gateway.http_api import KEEPALIVE_S, start_http
from asyncinfer.gateway.metrics import GatewayMetrics
from asyncinfer.gateway.open_files import connection_caps, raise_open_files_limit
from asyncinfer.gateway.repeated_logs import RepeatFolder
from asyncinfer.gateway.service import Service
from asyncinfer.gateway.shared_memory import SharedMemory
from asyncinfer.supervision.supervisor import CANNOT_START

__all__ = ["Ports", "run_gateway"]

log = logging.getLogger(__name__)

#: Seconds calls in flight get to finish when the gateway stops.
GRACE_S = 5.0
#: Threads that publish requests and run other Redis calls off the event loop.
EXECUTOR_THREADS = 16


@dataclass(frozen=True)
class Ports:
    host: str
    http: int
    grpc: int
    metrics: int

    @classmethod
    def of(cls, settings: Settings) -> Ports:
        return cls(settings.gateway_host, settings.http_port, settings.grpc_port,
                   settings.gateway_metrics_port)


def run_gateway(settings: Settings, ports: Ports | None = None, *, reuse_port: bool = False) -> int:
    """Serve until SIGTERM/SIGINT; the exit status (``CANNOT_START`` when a port cannot be bound).

    ``reuse_port``: bind the HTTP and gRPC ports with ``SO_REUSEPORT``, shared with the other
    processes of ``gateway --processes`` (processes.py); without it a port another process holds
    is an error."""
    ports = ports or Ports.of(settings)
    folder = RepeatFolder()
    folder.install()
    try:
        return asyncio.run(_serve(settings, ports, reuse_port, folder))
    except OSError as exc:
        print(f"asyncinfer gateway: cannot start: {exc}", file=sys.stderr, flush=True)
        return CANNOT_START
    finally:
        folder.flush(everything=True)
        folder.uninstall()


async def _serve(settings: Settings, ports: Ports, reuse_port: bool, folder: RepeatFolder) -> int:
    loop = asyncio.get_running_loop()
    caps = connection_caps(raise_open_files_limit(), settings.gateway_max_connections)
    log.info("gateway connection caps: HTTP %d, gRPC %d", caps.http, caps.grpc)
    flushing = loop.create_task(_flush_every(folder))
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(
        EXECUTOR_THREADS, thread_name_prefix="asyncinfer-gateway"))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # no tensor store of its own: a caller's references pass through as they came, and an output
    # comes by reference only to a caller that asked (data_ref_outputs), never for its size
    client = Client(settings=dataclasses.replace(settings, tensor_store_url=""))
    service = Service(client, version=__version__, tracing=client.sender.tracing,
                      shared_memory=SharedMemory(allowed=settings.allow_client_shm,
                                                 processes=2 if reuse_port else 1))
    await service.start()
    metrics = GatewayMetrics(lambda model: client.sender_for(model).broker, service.known_models,
                             lambda: service.in_flight)
    service.on_infer = metrics.record
    fronts: list[Any] = []
    try:
        if ports.http:
            fronts.append(await start_http(service, ports.host, ports.http,
                                           max_body_bytes=settings.max_payload_bytes,
                                           shutdown_timeout_s=GRACE_S / 2,  # aiohttp waits twice
                                           reuse_port=reuse_port, max_connections=caps.http,
                                           header_timeout_s=settings.gateway_header_timeout_s,
                                           body_timeout_s=settings.gateway_body_timeout_s))
        grpc_server = None
        if ports.grpc:
            grpc_server = await start_grpc(service, ports.host, ports.grpc,
                                           max_message_bytes=settings.max_payload_bytes,
                                           reuse_port=reuse_port, max_connections=caps.grpc,
                                           handshake_timeout_s=settings.gateway_header_timeout_s,
                                           idle_timeout_s=KEEPALIVE_S)
        metrics_server = metrics.serve(ports.host, ports.metrics) if ports.metrics else None
        where = [f"HTTP on http://{ports.host}:{ports.http}" if ports.http else "",
                 f"gRPC on {ports.host}:{ports.grpc}" if ports.grpc else "",
                 f"metrics on http://{ports.host}:{ports.metrics}/metrics" if ports.metrics else ""]
        # What startup made (modules, the client, the servers) lives as long as the process: the
        # collector need not walk it again on each full collection under load.
        gc.freeze()
        gc.set_threshold(20_000, 10, 10)
        print(f"asyncinfer gateway ready: {', '.join(w for w in where if w)} (pid {os.getpid()})",
              flush=True)
        await stop.wait()
        log.info("gateway stopping")
        service.stopping = True
        if grpc_server is not None:
            await grpc_server.stop(GRACE_S)
        if metrics_server is not None:
            metrics_server.shutdown()
    finally:
        for runner in fronts:
            await runner.cleanup()
        log.info("gateway: fronts closed")
        await service.close()
        flushing.cancel()
        log.info("gateway stopped")
    return 0


async def _flush_every(folder: RepeatFolder) -> None:
    """Log the counts of repeated records held back, once an interval."""
    while True:
        await asyncio.sleep(folder.interval_s)
        folder.flush()
