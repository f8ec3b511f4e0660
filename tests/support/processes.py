"""Worker, ``asyncinfer up`` and client subprocesses of the tests; each is stopped by its PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, TypeVar

from asyncinfer.supervision.processes import pid_alive, stop_process

__all__ = ["ROOT", "TEST_FACTORIES", "WORKER_MODELS", "SESSION_MAX_PAYLOAD_BYTES", "worker_env",
           "WorkerProcess", "launch_worker", "start_worker", "start_up", "stop_up",
           "embedded_up_env", "GatewayProcess", "launch_gateway", "start_gateway",
           "gateway_ports_env", "ready_together", "stop_together"]

#: The project's root folder (the working directory of every subprocess).
ROOT = Path(__file__).resolve().parents[2]
TEST_FACTORIES = ("sleep=tests.support.models:Sleep,poison=tests.support.models:Poison,"
                  "affine=tests.support.models:make_affine,affine3=tests.support.models:Affine3,"
                  "gated=tests.support.models:Gated,flaky=tests.support.models:Flaky,"
                  "broken=tests.support.models:Broken,crashy=tests.support.models:Crashy")
#: The models of the session worker (tests/conftest.py).
WORKER_MODELS = "identity,mlp,sleep,poison,affine,affine3"
#: ASYNCINFER_MAX_PAYLOAD_BYTES of the session worker: small, so tests can go over it cheaply.
SESSION_MAX_PAYLOAD_BYTES = 4 * 1024 * 1024


def worker_env(redis_url: str, **extra: str) -> dict[str, str]:
    """Environment for a worker or client subprocess talking to ``redis_url``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
    env.update(ASYNCINFER_BROKER_URL=redis_url, ASYNCINFER_MODEL_FACTORIES=TEST_FACTORIES,
               PYTHONPATH=str(ROOT), ASYNCINFER_LOG_LEVEL="info")
    env.update(extra)
    return env


class WorkerProcess:
    """A worker subprocess whose output goes to a log file; ready when Celery says so."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, *,
                 cwd: Path = ROOT) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(argv, env=env, cwd=cwd, stdout=self._log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    #: What its log says once it serves, and what it is called in errors.
    READY, WHAT = " ready.", "worker"

    def ready(self) -> bool:
        """Whether its log says it serves.

        Raises:
            RuntimeError: it exited, with the end of its log.
        """
        if self.READY in self.log():
            return True
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.WHAT} exited with {self.process.returncode}:\n"
                               f"{self.log()[-3000:]}")
        return False

    def wait_ready(self, timeout_s: float = 90.0) -> WorkerProcess:
        ready_together([self], timeout_s)
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        stop_process(self.process, signal.SIGTERM, timeout_s)
        self._log.close()


def launch_worker(redis_url: str, log_path: Path, *args: str, **env: str) -> WorkerProcess:
    """Start ``asyncinfer worker`` with ``args``; return at once (``wait_ready`` waits)."""
    argv = [sys.executable, "-m", "asyncinfer", "worker", *args]
    return WorkerProcess(argv, worker_env(redis_url, **env), log_path)


def start_worker(redis_url: str, log_path: Path, *args: str, **env: str) -> WorkerProcess:
    """Start ``asyncinfer worker`` with ``args`` and wait until it consumes."""
    return launch_worker(redis_url, log_path, *args, **env).wait_ready()


class GatewayProcess(WorkerProcess):
    """An ``asyncinfer gateway`` subprocess on free ports; ready when it says so."""

    READY, WHAT = "asyncinfer gateway ready", "gateway"

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, *, http_port: int,
                 grpc_port: int, metrics_port: int) -> None:
        super().__init__(argv, env, log_path)
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.http_url = f"127.0.0.1:{http_port}"
        self.grpc_url = f"127.0.0.1:{grpc_port}"


def launch_gateway(redis_url: str, log_path: Path, *args: str, **env: str) -> GatewayProcess:
    """Start ``asyncinfer gateway`` (with ``args``: ``--model-control-mode explicit``, say) on
    three free ports; return at once (``wait_ready`` or :func:`ready_together` waits)."""
    ports = [int(p) for p in gateway_ports_env().values()]
    argv = [sys.executable, "-m", "asyncinfer", "gateway", "--http-port", str(ports[0]),
            "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), *args]
    return GatewayProcess(argv, worker_env(redis_url, **env), log_path, http_port=ports[0],
                          grpc_port=ports[1], metrics_port=ports[2])


def start_gateway(redis_url: str, log_path: Path, *args: str, **env: str) -> GatewayProcess:
    """:func:`launch_gateway`, then wait until it serves."""
    proc = launch_gateway(redis_url, log_path, *args, **env)
    proc.wait_ready(60.0)
    return proc


P = TypeVar("P", bound=WorkerProcess)


def ready_together(procs: Sequence[P], timeout_s: float = 90.0) -> Sequence[P]:
    """Wait until every one of ``procs`` (launched, not waited for: they start side by side)
    serves, all within one ``timeout_s``; return them. If one exits or the time runs out, every
    one of them is stopped (by its PID) before the error is raised.

    Raises:
        RuntimeError: one exited (its log's end); TimeoutError: naming those not ready.
    """
    deadline = time.monotonic() + timeout_s
    waiting = list(procs)
    try:
        while waiting:
            waiting = [p for p in waiting if not p.ready()]
            if not waiting:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError("; ".join(f"{p.WHAT} {p.pid} not ready in {timeout_s} s:\n"
                                             f"{p.log()[-3000:]}" for p in waiting))
            time.sleep(0.05)
    except BaseException:
        stop_together(procs)
        raise
    return procs


def stop_together(procs: Iterable[WorkerProcess], timeout_s: float = 20.0,
                  sig: int = signal.SIGTERM) -> None:
    """Stop every one of ``procs`` by its PID at once: ``sig`` to each still running, then wait
    for them all within one ``timeout_s``, SIGKILL for any left; each one's log closed."""
    procs = list(procs)
    for p in procs:
        if p.process.poll() is None:
            try:
                p.process.send_signal(sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.process.kill()
            p.process.wait()
        finally:
            p._log.close()


def gateway_ports_env() -> dict[str, str]:
    """Free ports for the gateway of an ``asyncinfer up`` (never Triton's defaults, 8000-8002)."""
    from asyncinfer.ops.redis_server import free_port

    ports: set[int] = set()
    while len(ports) < 3:
        ports.add(free_port())
    http, grpc, metrics = sorted(ports)
    return {"ASYNCINFER_HTTP_PORT": str(http), "ASYNCINFER_GRPC_PORT": str(grpc),
            "ASYNCINFER_GATEWAY_METRICS_PORT": str(metrics)}


def start_up(env: dict[str, str], log: IO[bytes], *args: str) -> subprocess.Popen[bytes]:
    """Start ``asyncinfer up --devices cpu`` with ``args``, its output going to ``log`` (its
    gateway on free ports unless ``env`` names them)."""
    env = {**gateway_ports_env(), **env}
    return subprocess.Popen([sys.executable, "-m", "asyncinfer", "up", "--devices", "cpu", *args],
                            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop_up(up: subprocess.Popen[bytes], started: list[int]) -> None:
    """Stop an ``asyncinfer up`` by its PID, then SIGKILL every PID it started still alive."""
    stop_process(up, signal.SIGTERM, 30)
    for pid in started:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def embedded_up_env(state_dir: Path) -> dict[str, str]:
    """Environment for an ``asyncinfer up`` that starts its own Redis in ``state_dir``."""
    env = worker_env("", ASYNCINFER_STATE_DIR=str(state_dir), **gateway_ports_env())
    del env["ASYNCINFER_BROKER_URL"]
    return env


def run_cli(url: str, *args: str) -> str:
    """What ``asyncinfer ARGS`` prints on broker ``url`` (it must succeed)."""
    out = subprocess.run([sys.executable, "-m", "asyncinfer", *args], env=worker_env(url),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout
