"""The peers, Triton (through PyTriton) and Ray Serve, as ``asyncinfer bench --systems triton,ray``
measures them beside asyncinfer, on the same model with the same max batch and delay.

Their servers are no part of this package: they are scripts in a source checkout's
``bench/peers`` folder, and they pin their own dependencies, so they run from a venv of their own
(``make peers`` makes ``.venv-peers``). The bench finds both from its options, else the
environment, else the current directory:

- the folder: ``--peers-dir``, ``ASYNCINFER_PEERS_DIR``, ``./bench/peers``;
- the venv: ``--peers-venv``, ``ASYNCINFER_PEERS_VENV``, ``./.venv-peers``.

Where either is missing, each peer asked for is skipped in one line that says which, and the rest
of the bench runs.

What the folder holds, as the bench runs it (the peers venv's Python, with this ``asyncinfer``
package and the folder on ``PYTHONPATH``):

- ``<peer>_server.py --workload W --port P``: serves the workload's model, P being the port its
  load generator drives on 127.0.0.1; prints ``READY`` once it serves; stops on SIGTERM;
- ``loadgen.py``: :mod:`asyncinfer.ops.benchmark.v2_loadgen` with the peers as its targets
  (``--target triton``), its lines read by :func:`~asyncinfer.ops.benchmark.v2_loadgen.run_from_line`.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import asyncinfer
from asyncinfer.ops.benchmark.host import free_port, tree_pids
from asyncinfer.ops.benchmark.measure import Run
from asyncinfer.ops.benchmark.v2_loadgen import child_env, run_load
from asyncinfer.supervision.processes import die_with_parent, pid_alive, stop_process

__all__ = ["PEERS", "PEERS_DIR_ENV", "PEERS_VENV_ENV", "Peers", "PeerServer", "measure_peer",
           "missing_message"]

#: The peer systems ``asyncinfer bench --systems`` knows.
PEERS = ("triton", "ray")
#: Names the peers' folder (default: ``bench/peers`` in the current directory).
PEERS_DIR_ENV = "ASYNCINFER_PEERS_DIR"
#: Names the peers' venv (default: ``.venv-peers`` in the current directory).
PEERS_VENV_ENV = "ASYNCINFER_PEERS_VENV"
DEFAULT_DIR = Path("bench", "peers")
DEFAULT_VENV = Path(".venv-peers")
#: Ray starts a small cluster of its own: allow it time on a 2-core host.
READY_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Peers:
    """Where the peers' scripts (``folder``) and their venv are; neither need exist (``missing``)."""

    folder: Path
    venv: Path

    @classmethod
    def find(cls, folder: str | Path | None = None, venv: str | Path | None = None) -> Peers:
        """The paths given, else the environment's, else the defaults in the current directory."""
        return cls(Path(folder or os.environ.get(PEERS_DIR_ENV) or DEFAULT_DIR).absolute(),
                   Path(venv or os.environ.get(PEERS_VENV_ENV) or DEFAULT_VENV).absolute())

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def script(self, name: str) -> Path:
        return self.folder / name

    def missing(self, system: str) -> str | None:
        """What ``system`` lacks here, in words; None when it can run."""
        where = f"give --peers-dir or {PEERS_DIR_ENV}, or run from a source checkout's root"
        if not self.folder.is_dir():
            return f"no peers folder at {self.folder} ({where})"
        for name in (f"{system}_server.py", "loadgen.py"):
            if not self.script(name).is_file():
                return f"the peers folder {self.folder} has no {name} ({where})"
        if not self.python.exists():
            return (f"the peers venv ({self.venv}) is not there; `make peers` installs Triton (PyTriton) "
                    f"and Ray Serve into it (or give --peers-venv or {PEERS_VENV_ENV})")
        return None

    def env(self, log_dir: Path) -> dict[str, str]:
        """The peers' environment: asyncinfer's settings left out; on ``PYTHONPATH``, the folder and
        this ``asyncinfer`` package alone (a folder under ``log_dir`` that links to it), so that no
        other package of this venv shadows the peers venv's own."""
        path = log_dir / "peers-pythonpath"
        link = path / "asyncinfer"
        if not link.is_symlink():
            path.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path(asyncinfer.__file__).resolve().parent, target_is_directory=True)
        env = child_env()
        env["PYTHONPATH"] = os.pathsep.join(
            [str(path), str(self.folder), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
        return env


def missing_message(system: str, why: str) -> str:
    """The one line the bench prints when ``system`` cannot run here (``why``: ``Peers.missing``)."""
    return f"bench: skipping {system}: {why}"


class PeerServer:
    """A peer's server process (and what it starts), its port, and how to stop them all."""

    def __init__(self, system: str, workload: str, peers: Peers, log_dir: Path) -> None:
        if system not in PEERS:
            raise ValueError(f"unknown peer {system!r}; known: {', '.join(PEERS)}")
        why = peers.missing(system)
        if why is not None:
            raise RuntimeError(f"{system}: {why}")
        self.system, self.peers = system, peers
        self.port = free_port()
        argv = [str(peers.python), str(peers.script(f"{system}_server.py")), "--workload", workload,
                "--port", str(self.port)]
        self.log_path = log_dir / f"{system}-{workload}.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(argv, env=peers.env(log_dir), stdout=subprocess.PIPE,
                                        stderr=self._log, stdin=subprocess.DEVNULL,
                                        preexec_fn=die_with_parent())

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


def measure_peer(system: str, workload: str, levels: list[int], duration_s: float, log_dir: Path,
                 peers: Peers) -> list[Run]:
    """Closed-loop runs of ``system`` serving ``workload`` at each in-flight level: its server and
    the peers' load generator, both from the peers venv."""
    server = PeerServer(system, workload, peers, log_dir)
    try:
        server.wait_ready()
        return run_load([peers.python, peers.script("loadgen.py")], system, server.port, workload,
                        levels, duration_s, server.process.pid, log_dir, env=peers.env(log_dir))
    finally:
        server.stop()
