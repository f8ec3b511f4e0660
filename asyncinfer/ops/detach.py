"""``asyncinfer up --detach`` and ``asyncinfer down``.

``up --detach`` starts ``asyncinfer up`` (the same arguments) in a session of its own, its output
going to ``<state dir>/up.log``, and returns once every worker it supervises answers ``status``
and every model each of them hosts is in the model catalogue under that worker (so a client or
the gateway that starts right after finds every model it serves), saying how to stop it. The
running ``up`` keeps its PID in ``<state dir>/up.pid`` (0600); ``asyncinfer down`` sends it SIGTERM
and waits until it has stopped its workers and its Redis.

``asyncinfer down --purge`` then removes what ``up`` kept in its state folder: the embedded
Redis' folder (its append-only file, log, password and config), ``up.pid`` and ``up.log``, and
the folder itself once nothing else is in it (what ``up`` did not write there is left, and
named). It is refused while ``up`` or its Redis still runs (``up`` did not stop in time, or a
Redis outlived it), so no running server loses its files; with nothing running it purges alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncinfer.config.published import PID_FILE as REDIS_PID_FILE
from asyncinfer.config.published import published_url
from asyncinfer.config.settings import Settings
from asyncinfer.ops.redis_server import make_private_dir, write_private
from asyncinfer.supervision.processes import pid_alive
from asyncinfer.wire.model_versions import split_key

__all__ = ["PID_FILE", "LOG_FILE", "write_pid", "clear_pid", "running_pid", "detach", "down",
           "purge_state"]

PID_FILE = "up.pid"
LOG_FILE = "up.log"


def write_pid(settings: Settings) -> None:
    """Record this process as the running ``asyncinfer up``."""
    make_private_dir(settings.state_path)
    write_private(settings.state_path / PID_FILE, str(os.getpid()))


def clear_pid(settings: Settings) -> None:
    path = settings.state_path / PID_FILE
    if path.exists() and path.read_text().strip() == str(os.getpid()):
        path.unlink()


def running_pid(settings: Settings) -> int | None:
    """The PID of the ``asyncinfer up`` running on this state dir, if one is."""
    try:
        pid = int((settings.state_path / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def detach(argv: Sequence[str], settings: Settings, workers: int, timeout_s: float = 180.0) -> int:
    """Start ``asyncinfer up`` with ``argv`` in the background; return once ``workers`` workers
    answer and their models are in the catalogue (0), or when it exits or ``timeout_s`` passes
    first (1, with the end of its log)."""
    if running_pid(settings) is not None:
        print(f"asyncinfer up: already running (pid {running_pid(settings)}); stop it with "
              f"`asyncinfer down`", file=sys.stderr)
        return 1
    make_private_dir(settings.state_path)
    log_path = settings.state_path / LOG_FILE
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "asyncinfer", *argv], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + timeout_s
    with _Readiness(settings) as ready:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                print(f"asyncinfer up: exited with {proc.returncode} before its workers were "
                      f"ready:\n{_tail(log_path)}", file=sys.stderr)
                return 1
            if ready.workers() >= workers and ready.announced() and ready.gateway():
                print(f"asyncinfer up: running in the background (pid {proc.pid}, log "
                      f"{log_path}); stop it with `asyncinfer down`", flush=True)
                return 0
            time.sleep(0.5)
    print(f"asyncinfer up: its workers were not ready in {timeout_s:g} s (pid {proc.pid}, log "
          f"{log_path}); `asyncinfer down` stops it", file=sys.stderr)
    return 1


class _Readiness:
    """How many workers answer ``status``, and whether their models are in the catalogue, through
    one client made once the broker is known."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client: Any = None
        #: What the workers that answered last said they host: worker name → models.
        self.hosted: dict[str, list[str]] = {}

    def announced(self) -> bool:
        """Whether every model of every worker that answered is in the catalogue under it."""
        if self.client is None:
            return False
        try:
            entries = self.client.models()
        except Exception:  # noqa: BLE001 - not up yet
            return False
        # (a prefork worker's children announce as ``worker/pid``; version v of m, ``m@v``, is
        # in m's entry)
        names = {m: split_key(m)[0] for models in self.hosted.values() for m in models}
        return all(names[m] in entries and any(
            h.worker == worker or h.worker.startswith(worker + "/")
            for h in entries[names[m]].hosts)
            for worker, models in self.hosted.items() for m in models)

    def workers(self) -> int:
        from asyncinfer.ops.status import cluster_status

        try:
            if self.client is None:
                url = self.settings.broker_url or published_url(self.settings.redis_dir)
                if not url:
                    return 0  # the embedded Redis has not published its URL yet
                from asyncinfer.client import Client

                self.client = Client(broker_url=url)
            self.client.ping()
            status = cluster_status(self.client.app, timeout_s=0.5)
            self.hosted = {w.name: list(w.models) for w in status.workers}
            return len(status.workers)
        except Exception:  # noqa: BLE001 - not up yet
            return 0

    def gateway(self) -> bool:
        """Whether up's gateway answers (True when it has none, or no HTTP port)."""
        if not (self.settings.gateway and self.settings.http_port):
            return True
        import urllib.request

        url = f"http://{self.settings.gateway_host}:{self.settings.http_port}/v2/health/live"
        try:
            with urllib.request.urlopen(url, timeout=0.5) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def __enter__(self) -> _Readiness:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.client is not None:
            self.client.close()


def down(settings: Settings, timeout_s: float = 60.0, *, purge: bool = False) -> int:
    """Stop the running ``asyncinfer up`` (SIGTERM), waiting until it has exited; with ``purge``,
    then remove what it kept (:func:`purge_state`; with none running, purge alone)."""
    pid = running_pid(settings)
    if pid is None:
        if purge:
            return purge_state(settings)
        print(f"asyncinfer down: no 'asyncinfer up' is running (state dir {settings.state_path})",
              file=sys.stderr)
        return 1
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid_alive(pid):
        print(f"asyncinfer down: 'asyncinfer up' (pid {pid}) still runs after {timeout_s:g} s"
              + ("; nothing purged" if purge else ""), file=sys.stderr)
        return 1
    print(f"asyncinfer down: stopped 'asyncinfer up' (pid {pid})", flush=True)
    return purge_state(settings) if purge else 0


#: What a folder ``up``'s Redis wrote holds (one is enough): its password, config, log, data.
REDIS_FILES = ("password", "redis.conf", "redis.log", "appendonly.aof", "appendonlydir")


def purge_state(settings: Settings) -> int:
    """Remove what ``asyncinfer up`` kept in ``settings``' state folder: its Redis' folder (data,
    log, password), its PID file and log, then the folder once empty. Refused (1) while ``up`` or
    its Redis runs."""
    state, redis_dir = settings.state_path, settings.redis_dir
    pid = running_pid(settings)
    if pid is not None:
        print(f"asyncinfer down: 'asyncinfer up' (pid {pid}) still runs on {state}; --purge "
              f"removes its data only once it has stopped (run `asyncinfer down` first); nothing "
              f"purged", file=sys.stderr)
        return 1
    redis_pid = _running_redis(redis_dir)
    if redis_pid is not None:
        print(f"asyncinfer down: the embedded Redis of 'asyncinfer up' (pid {redis_pid}) still "
              f"runs on {redis_dir}; stop it first; nothing purged", file=sys.stderr)
        return 1
    if not state.is_dir():
        print(f"asyncinfer down: nothing to purge ({state} does not exist)", flush=True)
        return 0
    size = _size(state)
    try:
        if redis_dir.is_dir() and not redis_dir.is_symlink() and any(
                (redis_dir / name).exists() for name in REDIS_FILES):
            shutil.rmtree(redis_dir)
        for name in (PID_FILE, LOG_FILE):
            (state / name).unlink(missing_ok=True)
        left = sorted(p.name for p in state.iterdir())
        if not left:
            state.rmdir()
    except OSError as exc:
        print(f"asyncinfer down: could not purge {state}: {exc}", file=sys.stderr)
        return 1
    freed = (size - _size(state)) / 1e6  # (a folder removed has none)
    print(f"asyncinfer down: purged {state} ({freed:.1f} MB: the embedded Redis' data, log and "
          f"password, up's log)" + (f"; left what 'asyncinfer up' did not write there: "
                                    f"{', '.join(left)}" if left else ""), flush=True)
    return 0


def _running_redis(redis_dir: Path) -> int | None:
    """The PID of the Redis ``up`` started in ``redis_dir``, if it still runs."""
    try:
        pid = int((redis_dir / REDIS_PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def _size(folder: Path) -> int:
    """The bytes of the files under ``folder`` (links not followed)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total
