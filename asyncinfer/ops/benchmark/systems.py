"""The systems under test, each a real worker process on the bench's Redis.

``asyncinfer``: ``asyncinfer worker`` (fast consumer, dynamic batching). ``celery``: plain Celery,
one task per request, the same model code, the same thread concurrency. ``triton`` and ``ray``:
the peers (Triton through PyTriton, Ray Serve), a source checkout's scripts started from their own
venv (``make peers``) by :mod:`asyncinfer.ops.benchmark.peer_servers`. ``gateway`` (and ``gateway-http``): the
same ``asyncinfer worker`` behind one ``asyncinfer gateway``, driven over gRPC (HTTP) by Triton's
own client (:mod:`asyncinfer.ops.benchmark.v2_loadgen`), as the Triton peer is driven.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from celery import Celery

from asyncinfer.constants import TASK_NAME, queue_for
from asyncinfer.ops.benchmark.baseline import QUEUE_PREFIX as PLAIN_PREFIX
from asyncinfer.ops.benchmark.baseline import TASK as PLAIN_TASK
from asyncinfer.ops.benchmark.host import free_port
from asyncinfer.ops.benchmark.measure import Run
from asyncinfer.ops.benchmark.peer_servers import PEERS, Peers, measure_peer, missing_message
from asyncinfer.ops.benchmark.v2_loadgen import MODULE as LOADGEN_MODULE
from asyncinfer.ops.benchmark.v2_loadgen import child_env, run_load
from asyncinfer.ops.benchmark.workloads import Workload
from asyncinfer.supervision.processes import stop_process

__all__ = ["WorkerUnderTest", "GatewayUnderTest", "GATEWAYS", "start_system", "available_systems",
           "is_peer", "is_gateway", "measure_peer_runs", "measure_gateway_runs"]

_TICKS = os.sysconf("SC_CLK_TCK")
#: The systems that are ``asyncinfer worker`` behind ``asyncinfer gateway``: the front each drives.
GATEWAYS = {"gateway": "gRPC", "gateway-http": "HTTP"}
#: What ``asyncinfer gateway`` prints once it serves.
GATEWAY_READY = b"asyncinfer gateway ready"


class WorkerUnderTest:
    """A worker process: its task and queue, its CPU time, and how to stop it."""

    def __init__(self, system: str, argv: list[str], env: dict[str, str], log_path: Path,
                 hostname: str, task: str, queue: str) -> None:
        self.system = system
        self.hostname = hostname
        self.task = task
        self.queue = queue
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)

    def wait_ready(self, app: Celery, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.system} worker exited: {self.log_path.read_text()[-2000:]}")
            if app.control.ping(destination=[self.hostname], timeout=0.5):
                return
        raise TimeoutError(f"{self.system} worker not ready in {timeout_s} s")

    def cpu_s(self) -> float:
        """User + system CPU seconds of the worker process so far."""
        return process_cpu_s(self.process.pid)

    def stop(self) -> None:
        stop_process(self.process, signal.SIGTERM, 30)
        self._log.close()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _env(broker_url: str, concurrency: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
    env.update(ASYNCINFER_BROKER_URL=broker_url, ASYNCINFER_LOG_LEVEL="warning",
               ASYNCINFER_CONCURRENCY=str(concurrency))
    return env


class GatewayUnderTest:
    """One ``asyncinfer gateway`` on free ports of 127.0.0.1: its ports, CPU time, how to stop it."""

    def __init__(self, broker_url: str, log_path: Path) -> None:
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.log_path = log_path
        self._log = open(log_path, "wb")
        argv = [sys.executable, "-m", "asyncinfer", "gateway", "--host", "127.0.0.1",
                "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                "--metrics-port", str(self.metrics_port)]
        self.process = subprocess.Popen(argv, env=_env(broker_url, 1), stdout=self._log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def port(self, system: str) -> int:
        """The port of the front ``system`` drives."""
        return self.http_port if GATEWAYS[system] == "HTTP" else self.grpc_port

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if GATEWAY_READY in self.log_path.read_bytes():
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.process.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
        raise RuntimeError(f"gateway not ready in {timeout_s} s")

    def stop(self) -> None:
        stop_process(self.process, signal.SIGTERM, 30)
        self._log.close()


def start_system(system: str, workload: Workload, broker_url: str, log_dir: Path,
                 concurrency: int, device: str = "cpu") -> WorkerUnderTest:
    """Start the worker of ``system`` for ``workload`` (a gateway system: the ``asyncinfer`` one)."""
    host = socket.gethostname()
    env = _env(broker_url, concurrency)
    if workload.factories:
        env["ASYNCINFER_MODEL_FACTORIES"] = workload.factories
    if workload.options:
        import json

        env["ASYNCINFER_MODEL_OPTIONS"] = json.dumps({workload.model: workload.options})
    log_path = log_dir / f"{system}-{workload.name}.log"
    if system == "asyncinfer" or system in GATEWAYS:
        hostname = f"bench-{system}@{host}"
        argv = [sys.executable, "-m", "asyncinfer", "worker", "--device", device,
                "--models", workload.model, "--hostname", hostname]
        return WorkerUnderTest(system, argv, env, log_path, hostname, TASK_NAME,
                               queue_for(workload.model))
    if system == "celery":
        hostname = f"bench-celery@{host}"
        queue = PLAIN_PREFIX + workload.model
        argv = [sys.executable, "-m", "celery", "-A", "asyncinfer.ops.benchmark.baseline", "worker",
                "-P", "threads", "-c", str(concurrency), "-Q", queue, "-n", hostname, "-l", "WARNING"]
        return WorkerUnderTest(system, argv, env, log_path, hostname, PLAIN_TASK, queue)
    raise ValueError(f"unknown system {system!r}")


def payload_kwargs(workload: Workload, i: int) -> dict[str, Any]:
    """The task keyword arguments of request ``i``."""
    return {"model": workload.model, **workload.payload(i)}


def available_systems(systems: list[str], peers: Peers | None = None) -> list[str]:
    """``systems`` less the peers (triton, ray) that cannot run here (``peers``: where they are;
    default: ``Peers.find()``), each named in one line that says what is missing."""
    peers = peers or Peers.find()
    kept = []
    for system in systems:
        why = peers.missing(system) if system in PEERS else None
        if why is not None:
            print(missing_message(system, why))
        else:
            kept.append(system)
    return kept


def is_peer(system: str) -> bool:
    """Whether ``system`` is a peer serving stack (started from the peers venv), not a worker."""
    return system in PEERS


def measure_peer_runs(system: str, workload: Workload, levels: list[int], duration_s: float,
                      log_dir: Path, peers: Peers) -> list[Run]:
    """Closed-loop runs of a peer on ``workload``; none (and one line saying why) when it fails."""
    if workload.name.startswith("pipeline3"):
        return []  # the pipelined/serial comparison is asyncinfer's own
    try:
        return measure_peer(system, workload.name, levels, duration_s, log_dir, peers)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"bench: {system} on {workload.name} failed: {str(exc).splitlines()[0]}")
        return []


def is_gateway(system: str) -> bool:
    """Whether ``system`` is ``asyncinfer worker`` driven through ``asyncinfer gateway``."""
    return system in GATEWAYS


def measure_gateway_runs(system: str, workload: Workload, worker: WorkerUnderTest, broker_url: str,
                         levels: list[int], duration_s: float, log_dir: Path,
                         redis_pid: int | None = None) -> list[Run]:
    """Closed-loop runs of ``worker`` behind one ``asyncinfer gateway`` (started and stopped here),
    driven as the Triton peer is (Triton's client, the load generator in a process of its own);
    the gateway's and the worker's CPU in their own columns. None (and one line why) on failure."""
    gateway = GatewayUnderTest(broker_url, log_dir / f"{system}-{workload.name}-gateway.log")
    try:
        gateway.wait_ready()
        pids = {"worker": worker.process.pid, **({"redis": redis_pid} if redis_pid else {})}
        return run_load([sys.executable, "-m", LOADGEN_MODULE], system, gateway.port(system),
                        workload.name, levels, duration_s, gateway.process.pid, log_dir,
                        server="gateway", cpu_pids=pids, env=child_env())
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"bench: {system} on {workload.name} failed: {str(exc).splitlines()[0]}")
        return []
    finally:
        gateway.stop()
