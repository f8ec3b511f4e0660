"""``asyncinfer gateway --processes N``: N gateway processes on the same HTTP and gRPC ports.

One gateway process is one event loop, so it uses about one core. With ``--processes N`` this
process becomes a supervisor (:class:`~asyncinfer.supervision.supervisor.Supervisor`, as ``asyncinfer
up``'s) of N ``asyncinfer gateway`` children that bind the HTTP and gRPC ports with
``SO_REUSEPORT``: the kernel spreads new connections over them (a connection stays with the child
that accepted it). Child ``i`` serves its metrics on the metrics port + ``i``. A child that dies is
started again; SIGTERM or SIGINT stops every child by its PID (SIGTERM, then SIGKILL after the
grace period) and waits for it; a child never outlives its supervisor (Linux: it gets SIGTERM
when the supervisor dies, even by SIGKILL).

It is opt-in because ``SO_REUSEPORT`` would let a second gateway share a taken port silently:
before starting anything the supervisor binds each port once without it, so a port another
process holds (a plain gateway, or another ``--processes`` one) is still an error, as it is
without the option.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
from types import FrameType

from asyncinfer.config.settings import Settings
from asyncinfer.gateway.server import GRACE_S, Ports
from asyncinfer.supervision.supervisor import CANNOT_START, Child, Supervisor

__all__ = ["run_gateway_processes", "child_ports", "check_free"]

log = logging.getLogger(__name__)


def child_ports(ports: Ports, index: int) -> Ports:
    """The ports of child ``index``: the shared HTTP and gRPC ports, its own metrics port."""
    return Ports(ports.host, ports.http, ports.grpc, ports.metrics + index if ports.metrics else 0)


def check_free(host: str, port: int, what: str) -> None:
    """Raise OSError (naming ``what`` and the address) unless ``host:port`` can be bound now
    without ``SO_REUSEPORT``: no other process listens there, with or without it."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot bind {what} to {host}:{port}: {exc}") from exc
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                    continue  # an address this host does not have (no IPv6): the server's to say
                raise OSError(f"cannot bind {what} to {host}:{port}: {exc.strerror or exc} "
                              f"(another process holds it)") from exc


def run_gateway_processes(settings: Settings, ports: Ports, processes: int) -> int:
    """Supervise ``processes`` gateway children on ``ports`` until SIGTERM/SIGINT; the exit
    status (``CANNOT_START`` when a port is taken, or a child cannot start)."""
    try:
        for what, port in (("HTTP", ports.http), ("gRPC", ports.grpc)):
            if port:
                check_free(ports.host, port, what)
        for i in range(processes):
            if ports.metrics:
                check_free(ports.host, child_ports(ports, i).metrics, f"process {i}'s metrics")
    except OSError as exc:
        print(f"asyncinfer gateway: cannot start: {exc}", file=sys.stderr, flush=True)
        return CANNOT_START
    env = dict(os.environ)
    if settings.broker_url:  # the URL this process settled on, not a second guess in each child
        env["ASYNCINFER_BROKER_URL"] = settings.broker_url
    # what the supervisor's flag or environment chose, for every child
    env["ASYNCINFER_MODEL_CONTROL_MODE"] = settings.model_control_mode
    children = [Child(name=f"gateway process {i}", argv=_argv(child_ports(ports, i)), env=env)
                for i in range(processes)]
    supervisor = Supervisor(children, grace_s=3 * GRACE_S)

    def _stop(signum: int, frame: FrameType | None) -> None:
        supervisor.stop()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    print(f"asyncinfer gateway: {processes} processes sharing "
          + ", ".join(p for p in (f"HTTP {ports.host}:{ports.http}" if ports.http else "",
                                  f"gRPC {ports.host}:{ports.grpc}" if ports.grpc else "") if p)
          + (f"; metrics on {ports.metrics}-{ports.metrics + processes - 1}" if ports.metrics
             else "") + f" (supervisor pid {os.getpid()})", flush=True)
    supervisor.run()
    if supervisor.failure is not None:
        name, line = supervisor.failure
        print(f"asyncinfer gateway: {name} failed to start {supervisor.max_start_failures} times "
              f"in a row; stopped: {line}", file=sys.stderr, flush=True)
        return CANNOT_START
    print("asyncinfer gateway: stopped", flush=True)
    return 0


def _argv(ports: Ports) -> list[str]:
    return [sys.executable, "-m", "asyncinfer", "gateway", "--host", ports.host,
            "--http-port", str(ports.http), "--grpc-port", str(ports.grpc),
            "--metrics-port", str(ports.metrics), "--reuse-port"]
