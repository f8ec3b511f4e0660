"""The bench's side of a peer (project venv): start its server from the peers venv, run its load
generator there, and turn each JSON line the generator prints into the bench's own ``Run``."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from asyncinfer.bench.measure import Run
from asyncinfer.bench.peers import PEERS, peers_python, project_root
from asyncinfer.bench.peers.host import tree_pids
from asyncinfer.processes import die_with_parent, pid_alive, stop_process

__all__ = ["PeerServer", "measure_peer", "run_from_line", "run_load", "free_port"]

#: Ray starts a small cluster of its own: allow it time on a 2-core host.
READY_TIMEOUT_S = 240.0
#: A process's name in a load generator line → the ``Run`` field of its CPU ms per request.
_CPU_COLUMNS = {"worker": "worker_cpu_ms_per_request", "gateway": "gateway_cpu_ms_per_request",
                "client": "client_cpu_ms_per_request", "redis": "redis_cpu_ms_per_request"}


def run_from_line(system: str, workload: str, line: str, server: str = "worker") -> Run:
    """One JSON line of the peers' load generator as the bench's ``Run`` (closed loop).

    The server's processes take the ``server`` CPU column (``worker`` for a peer; ``gateway`` for
    ``asyncinfer gateway``), the generator the ``client`` one; the processes of the line's
    ``cpu_s`` (``worker``, ``redis``) take their own columns; a peer has no Redis. Raises
    ValueError on a line that is not such a result."""
    if server not in _CPU_COLUMNS:
        raise ValueError(f"unknown CPU column {server!r}; known: {', '.join(_CPU_COLUMNS)}")
    try:
        doc: dict[str, Any] = json.loads(line)
        latencies = [float(x) for x in doc["latencies_ms"]]
        run = Run(system, workload, "closed", int(doc["level"]), latencies_ms=latencies,
                  failures=int(doc["failures"]), elapsed_s=float(doc["elapsed_s"]),
                  batch_sizes=Counter({int(k): int(v) for k, v in doc["batch_sizes"].items()}))
        n = max(1, len(latencies))
        seconds = {server: float(doc["server_cpu_s"]), "client": float(doc["client_cpu_s"])}
        seconds.update({k: float(v) for k, v in (doc.get("cpu_s") or {}).items() if k in _CPU_COLUMNS})
        for column, value in seconds.items():
            setattr(run, _CPU_COLUMNS[column], value * 1000.0 / n)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a load generator result line: {line[:200]!r} ({exc})") from exc
    run.rows = len(latencies)
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
    root = str(project_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


class PeerServer:
    """A peer's server process (and what it starts), its port, and how to stop them all."""

    def __init__(self, system: str, workload: str, log_dir: Path) -> None:
        if system not in PEERS:
            raise ValueError(f"unknown peer {system!r}; known: {', '.join(PEERS)}")
        python = peers_python()
        if python is None:
            raise RuntimeError(f"{system}: the peers venv is not there (make peers)")
        self.system, self.python = system, python
        self.port = free_port()
        argv = [str(python), "-m", f"asyncinfer.bench.peers.{system}_server", "--workload", workload]
        if system == "triton":
            argv += ["--grpc-port", str(self.port), "--http-port", str(free_port()),
                     "--metrics-port", str(free_port())]
        else:
            argv += ["--http-port", str(self.port)]
        self.log_path = log_dir / f"{system}-{workload}.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=self._log,
                                        stdin=subprocess.DEVNULL, preexec_fn=die_with_parent())

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.process.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if sel.select(timeout=1.0):
                    line = self.process.stdout.readline()
                    if line.strip() == b"READY":
                        return
                    if not line and self.process.poll() is not None:
                        break
        tail = self.log_path.read_text(errors="replace")[-3000:]
        status = self.process.poll()
        why = f"exited with {status}" if status is not None else f"not ready in {timeout_s} s"
        raise RuntimeError(f"{self.system} server {why}: {tail}")

    def stop(self) -> None:
        """SIGTERM the server, then SIGKILL by PID whatever it started and left running."""
        started = [p for p in tree_pids(self.process.pid) if p != self.process.pid]
        stop_process(self.process, signal.SIGTERM, 60)
        for pid in started:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()


def run_load(python: Path | str, target: str, port: int, workload: str, levels: list[int],
             duration_s: float, server_pid: int, log_dir: Path, *, server: str = "worker",
             cpu_pids: dict[str, int] | None = None, env: dict[str, str] | None = None) -> list[Run]:
    """Run the load generator with ``python`` against ``target`` on ``port``: one closed-loop
    ``Run`` per in-flight level (``server`` names the CPU column of ``server_pid``)."""
    argv = [str(python), "-m", "asyncinfer.bench.peers.loadgen", "--peer", target,
            "--port", str(port), "--workload", workload,
            "--in-flight", ",".join(str(n) for n in levels), "--duration-s", str(duration_s),
            "--server-pid", str(server_pid)]
    argv += [a for name, pid in (cpu_pids or {}).items() for a in ("--cpu-pid", f"{name}={pid}")]
    log = log_dir / f"{target}-{workload}-loadgen.log"
    timeout_s = 300 + len(levels) * (duration_s + 60)
    with open(log, "wb") as err:
        done = subprocess.run(argv, env=env or _env(), stdout=subprocess.PIPE, stderr=err,
                              stdin=subprocess.DEVNULL, timeout=timeout_s, check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{target} load generator exited {done.returncode}: {tail}")
    lines = [x for x in done.stdout.decode().splitlines() if x.startswith("{")]
    return [run_from_line(target, workload, x, server) for x in lines]


def measure_peer(system: str, workload: str, levels: list[int], duration_s: float,
                 log_dir: Path) -> list[Run]:
    """Closed-loop runs of ``system`` serving ``workload`` at each in-flight level."""
    server = PeerServer(system, workload, log_dir)
    try:
        server.wait_ready()
        return run_load(server.python, system, server.port, workload, levels, duration_s,
                        server.process.pid, log_dir)
    finally:
        server.stop()
