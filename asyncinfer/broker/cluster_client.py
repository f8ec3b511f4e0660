"""A client of one shard of the fleet on a Redis Cluster: a plain redis-py client whose keys all
live in the shard's hash slot, on whichever master owns that slot now.

One shard (broker/shards.py) is one hash slot, so all that asyncinfer does with it is what it does
with one Redis: its scripts, transactions, blocking pops, ``WAIT`` and ``TIME`` go to one node,
the slot's master. The client is a ``redis.Redis``; its connections

- ask the cluster who owns the slot whenever they open a socket (``CLUSTER SLOTS`` of a node they
  know: the URL's seeds, then every node a reply named; a client reads it, and the servers'
  ``COMMAND`` table, ~50 KB, on its first connect);
- add the shard's hash tag to each key argument as they pack a command (cluster_keys.py), and the
  client takes it off the key names its replies carry;
- turn a reply that says the command ran nowhere into :class:`SlotMoving`, a ConnectionError:
  ``MOVED`` (the slot has a new master: a failover promoted a replica, or a resharding moved it;
  the new owner is noted, and the next connect goes there), ``ASK`` and ``TRYAGAIN`` (the slot is
  migrating now, and a key the command names is on the target already), ``CLUSTERDOWN``. The
  client sends such a command again, for up to :data:`SETTLE_S`; a pipeline raises it, for the
  retry that every asyncinfer loop makes, as after a Sentinel failover (connections.py). None is
  ever run twice by this.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis
from redis.connection import Connection, SSLConnection

from asyncinfer.broker.cluster_keys import (
    KEY_REPLY_COMMANDS,
    KeyTable,
    prefixed_command,
    unprefixed,
)
from asyncinfer.broker.command_packer import HiredisPacker
from asyncinfer.broker.shards import key_prefix, shard_tags, tag_slot
from asyncinfer.broker.urls import ClusterUrl, parse_cluster_url

__all__ = ["SlotMap", "SlotMoving", "ShardClient", "shard_client", "SETTLE_S"]

log = logging.getLogger(__name__)

#: Commands a connection sends before it knows where keys stand: none names a key.
_SETUP_COMMANDS = {"AUTH", "HELLO", "CLIENT", "COMMAND", "PING", "SELECT", "READONLY", "ECHO"}
#: The shortest time (seconds) between two readings of the slot map.
_REFRESH_EVERY_S = 0.1
#: How long (seconds) a shard's client sends a command again that met its slot moving (``MOVED``,
#: ``ASK``, ``TRYAGAIN``, ``CLUSTERDOWN``: it ran nowhere) before it raises SlotMoving: a
#: resharding moves a slot's keys in well under this, a failover promotes a replica in about the
#: cluster's node timeout (15 s by default: past this, the caller's own retries go on).
SETTLE_S = 10.0


class SlotMoving(redis.ConnectionError):
    """The command ran nowhere: its slot has moved or is moving (``MOVED``, ``ASK``, ``TRYAGAIN``),
    or the cluster is down (``CLUSTERDOWN``). Sending it again is safe."""


class SlotMap:
    """Which master owns each hash slot of one cluster, read from its nodes (``CLUSTER SLOTS``)
    and corrected by the ``MOVED`` replies met; and the servers' table of key positions."""

    def __init__(self, url: ClusterUrl, timeout_s: float = 5.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.nodes: list[tuple[str, int]] = list(url.seeds)
        self._starts: list[int] = []  # sorted starts of the slot ranges
        self._ranges: list[tuple[int, int, tuple[str, int]]] = []
        self._moved: dict[int, tuple[str, int]] = {}
        self._stale = True
        self._read_at = 0.0
        self._lock = threading.Lock()
        self.key_table: KeyTable | None = None

    def owner(self, slot: int) -> tuple[str, int]:
        """The address of the master of ``slot`` (read again when the map is stale)."""
        with self._lock:
            if self._stale:
                self._read()
            if slot in self._moved:
                return self._moved[slot]
            at = bisect.bisect_right(self._starts, slot) - 1
            if at >= 0 and self._ranges[at][0] <= slot <= self._ranges[at][1]:
                return self._ranges[at][2]
        raise redis.ConnectionError(f"no master of the Redis Cluster owns slot {slot} now")

    def moved(self, slot: int, address: tuple[str, int]) -> None:
        """A node said ``slot`` is served at ``address`` now."""
        with self._lock:
            self._moved[slot] = address
            if address not in self.nodes:
                self.nodes.append(address)

    def stale(self) -> None:
        """A master could not be reached: read the map again before the next connect."""
        with self._lock:
            self._stale = True

    def _client(self, address: tuple[str, int]) -> redis.Redis:
        kwargs: dict[str, Any] = {"socket_timeout": self.timeout_s,
                                  "socket_connect_timeout": self.timeout_s}
        if self.url.username:
            kwargs["username"] = self.url.username
        if self.url.password:
            kwargs["password"] = self.url.password
        if self.url.tls:
            kwargs["ssl"] = True
        client = redis.Redis(host=address[0], port=address[1], **kwargs)
        client.response_callbacks.pop("COMMAND", None)  # the reply as Redis sends it
        client.response_callbacks.pop("CLUSTER SLOTS", None)
        return client

    def _read(self) -> None:
        wait_s = self._read_at + _REFRESH_EVERY_S - time.monotonic()
        if wait_s > 0:
            time.sleep(wait_s)
        self._read_at = time.monotonic()
        last: Exception | None = None
        for address in list(self.nodes):
            client = self._client(address)
            try:
                reply = client.execute_command("CLUSTER SLOTS")
                if self.key_table is None:
                    self.key_table = KeyTable(client.execute_command("COMMAND"))
            except redis.RedisError as exc:
                last = exc
                continue
            finally:
                client.close()
            self._take(reply)
            return
        raise redis.ConnectionError(f"no node of the Redis Cluster answered ({last})")

    def _take(self, reply: Sequence[Any]) -> None:
        ranges = []
        for entry in reply:
            host = entry[2][0].decode() if isinstance(entry[2][0], bytes) else str(entry[2][0])
            master = (host or self.nodes[0][0], int(entry[2][1]))
            ranges.append((int(entry[0]), int(entry[1]), master))
            for node in entry[2:]:
                node_host = node[0].decode() if isinstance(node[0], bytes) else str(node[0])
                address = (node_host or self.nodes[0][0], int(node[1]))
                if address not in self.nodes:
                    self.nodes.append(address)
        ranges.sort()
        self._ranges = ranges
        self._starts = [r[0] for r in ranges]
        self._moved.clear()
        self._stale = False


class _ShardPacker(HiredisPacker):
    """Packs a command with the shard's hash tag before each key."""

    def __init__(self, prefix: bytes, slots: SlotMap) -> None:
        super().__init__()
        self.prefix = prefix
        self.slots = slots

    def pack(self, *args: Any) -> list[bytes]:
        table = self.slots.key_table
        if table is None:
            name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
            if name.split()[0].upper() not in _SETUP_COMMANDS:
                raise redis.ConnectionError("the Redis Cluster's command table is not read yet")
            return super().pack(*args)
        first = args[0]
        if (type(first) is str and " " in first) or (type(first) is bytes and b" " in first):
            args = (*first.split(), *args[1:])  # "CLIENT SETNAME": two words
        return super().pack(*prefixed_command(args, self.prefix, table))


class _FollowsSlot:
    """What a shard's connection adds to redis-py's: its address is the slot's master's."""

    slots: SlotMap
    slot: int
    host: str
    port: int

    def _connect(self) -> Any:
        self.host, self.port = self.slots.owner(self.slot)
        try:
            return super()._connect()  # type: ignore[misc]
        except OSError:
            self.slots.stale()
            raise

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.exceptions.MovedError as exc:
            self.slots.moved(self.slot, (exc.host, int(exc.port)))
            raise SlotMoving(f"slot {self.slot} moved to {exc.host}:{exc.port}") from exc
        except (redis.exceptions.AskError, redis.exceptions.TryAgainError,
                redis.exceptions.ClusterDownError) as exc:
            raise SlotMoving(f"slot {self.slot} is moving or the cluster is down ({exc})") from exc
        except redis.ConnectionError:
            self.slots.stale()
            raise


class _ShardConnection(_FollowsSlot, Connection):
    def __init__(self, *, slots: SlotMap, slot: int, **kwargs: Any) -> None:
        self.slots, self.slot = slots, slot
        super().__init__(**kwargs)


class _ShardSSLConnection(_FollowsSlot, SSLConnection):
    def __init__(self, *, slots: SlotMap, slot: int, **kwargs: Any) -> None:
        self.slots, self.slot = slots, slot
        super().__init__(**kwargs)


class ShardClient(redis.Redis):
    """A client of one shard of the fleet on a Redis Cluster (see the module's text), on a pool
    that :func:`shard_client` made: the replies of it and its pipelines name keys without the
    shard's tag, and a command that meets its slot moving is sent again (for up to
    :data:`SETTLE_S`) where the slot is now. A pipeline's is not (some of its commands may have
    run): it raises SlotMoving, a ConnectionError, for its caller to retry."""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        deadline, pause_s = time.monotonic() + SETTLE_S, 0.01
        while True:
            try:
                return super().execute_command(*args, **options)
            except SlotMoving:
                if time.monotonic() + pause_s > deadline:
                    raise
                time.sleep(pause_s)
                pause_s = min(pause_s * 2, 0.2)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        packer = self.connection_pool.connection_kwargs.get("command_packer")
        #: What each key of the shard starts with.
        self.key_prefix: bytes = packer.prefix if isinstance(packer, _ShardPacker) else b""
        for name in KEY_REPLY_COMMANDS:
            self.response_callbacks[name] = _unprefixing(name, self.response_callbacks.get(name),
                                                         self.key_prefix)


def _unprefixing(name: str, callback: Any, prefix: bytes) -> Any:
    def parse(response: Any, **options: Any) -> Any:
        response = unprefixed(name, response, prefix)
        return callback(response, **options) if callback is not None else response
    return parse


def shard_client(url: str, shard: int | None = None, **kwargs: Any) -> ShardClient:
    """A client of shard ``shard`` (default: the one the URL names) of the cluster ``url``
    (``rediscluster://…``); ``kwargs`` go to redis-py's connections, as for
    :func:`~asyncinfer.broker.connections.redis_client`."""
    parsed = parse_cluster_url(url)
    shard = parsed.shard if shard is None else shard
    if not 0 <= shard < parsed.shards:
        raise ValueError(f"shard {shard} of a cluster URL with {parsed.shards} shards")
    slots = SlotMap(parsed)  # read on the first connect: the owners, the servers' COMMAND table
    tag = shard_tags(parsed.shards)[shard]
    prefix = key_prefix(tag)
    single = bool(kwargs.pop("single_connection_client", False))
    kwargs.pop("command_packer", None)
    if parsed.username:
        kwargs.setdefault("username", parsed.username)
    if parsed.password:
        kwargs.setdefault("password", parsed.password)
    pool = redis.ConnectionPool(
        connection_class=_ShardSSLConnection if parsed.tls else _ShardConnection,
        slots=slots, slot=tag_slot(tag), command_packer=_ShardPacker(prefix, slots), **kwargs)
    return ShardClient(connection_pool=pool, single_connection_client=single)
