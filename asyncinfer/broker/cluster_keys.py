"""Which arguments of a Redis command are keys, and the command with its keys in a shard's hash tag.

On a Redis Cluster every key of one shard of the fleet (cluster_client.py) starts with that
shard's hash tag (``{s3.41}``): Redis places a key by the text inside its first ``{…}``, so all of
a shard's keys share one hash slot, and every script, transaction and multi-key command of the
fleet touches one slot, as Cluster requires. The code above a shard's client names keys as it
does on one Redis; its connections add the tag to each key argument as they pack a command, and
its replies that carry key names (``BRPOP``, ``SCAN``, ``KEYS``, ``XREAD``) have it taken off.

Where a command's keys stand comes from the server's own ``COMMAND`` table (first key, last key,
step), read once a process. Commands whose keys move with their arguments are placed here by
their documented forms (``EVAL``'s ``numkeys``, ``XREAD``'s ``STREAMS``); one this module does
not know is refused (a ``DataError`` naming it), never sent with a key left outside the shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis

__all__ = ["KeyTable", "key_table", "prefixed_command", "unprefixed", "KEY_REPLY_COMMANDS"]

#: A command's key positions: (first, last, step) as ``COMMAND`` gives them (last < 0: from the end).
Spec = tuple[int, int, int]

#: Commands whose argument ``numkeys`` (at the given position) counts the keys right after it.
_NUMKEYS_AT = {"EVAL": 2, "EVALSHA": 2, "EVAL_RO": 2, "EVALSHA_RO": 2, "FCALL": 2, "FCALL_RO": 2,
               "ZUNION": 1, "ZINTER": 1, "ZDIFF": 1, "ZINTERCARD": 1, "SINTERCARD": 1,
               "LMPOP": 1, "ZMPOP": 1, "BLMPOP": 2, "BZMPOP": 2}
#: Commands with a destination key first, then ``numkeys`` and the keys.
_DEST_NUMKEYS = {"ZUNIONSTORE", "ZINTERSTORE", "ZDIFFSTORE"}
#: Container commands whose subcommand names a key at position 2 (``OBJECT ENCODING key``).
_SUBCOMMAND_KEY = {"OBJECT": {"ENCODING", "FREQ", "IDLETIME", "REFCOUNT"},
                   "MEMORY": {"USAGE"}, "XINFO": {"CONSUMERS", "GROUPS", "STREAM"}}
#: Commands whose reply names keys (taken out of the shard again by :func:`unprefixed`).
KEY_REPLY_COMMANDS = ("BLPOP", "BRPOP", "BZPOPMIN", "BZPOPMAX", "SCAN", "KEYS", "XREAD",
                      "XREADGROUP")
#: Commands a shard must not send: they act on every shard of the node, or on no key at all
#: where a key is meant.
_REFUSED = {"FLUSHDB", "FLUSHALL", "RANDOMKEY", "DBSIZE", "SELECT", "SWAPDB", "MIGRATE", "SORT",
            "SORT_RO", "MOVE", "COPY"}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class KeyTable:
    """Key positions of every command a server knows, from its ``COMMAND`` reply."""

    def __init__(self, reply: Sequence[Any]) -> None:
        self.specs: dict[str, Spec] = {}
        self.movable: set[str] = set()
        for entry in reply:
            self._add(entry)

    def _add(self, entry: Sequence[Any]) -> None:
        name = _text(entry[0]).upper()
        flags = {_text(f).lower() for f in entry[2]}
        self.specs[name] = (int(entry[3]), int(entry[4]), int(entry[5]))
        if "movablekeys" in flags:
            self.movable.add(name)
        if len(entry) > 9 and entry[9]:  # Redis 7: the subcommands, "object|encoding" ...
            for sub in entry[9]:
                self._add(sub)

    def positions(self, args: Sequence[Any]) -> list[int]:
        """The positions in ``args`` (the command's name first) of its keys."""
        name = _text(args[0]).upper()
        if name in _REFUSED:
            raise redis.DataError(f"{name} is not sent to a Redis Cluster shard of asyncinfer: it "
                                  "acts on every key of the node, or on keys outside the shard")
        if name in _NUMKEYS_AT:
            at = _NUMKEYS_AT[name]
            return list(range(at + 1, at + 1 + int(args[at]))) if len(args) > at else []
        if name in _DEST_NUMKEYS:
            return [1, *range(3, 3 + int(args[2]))] if len(args) > 2 else []
        if name in ("XREAD", "XREADGROUP"):
            words = [_text(a).upper() if isinstance(a, (str, bytes)) else "" for a in args]
            start = words.index("STREAMS") + 1 if "STREAMS" in words else len(args)
            return list(range(start, start + (len(args) - start) // 2))
        if name in _SUBCOMMAND_KEY:
            sub = _text(args[1]).upper() if len(args) > 1 else ""
            return [2] if sub in _SUBCOMMAND_KEY[name] and len(args) > 2 else []
        spec = self.specs.get(name)
        if spec is None:
            raise redis.DataError(f"{name} is unknown to this Redis: not sent to a Cluster shard")
        if name in self.movable:
            raise redis.DataError(f"{name} places its keys by its arguments, which asyncinfer's "
                                  "Redis Cluster shards do not read: not sent")
        first, last, step = spec
        if first <= 0:
            return []
        end = len(args) + last if last < 0 else last
        return list(range(first, min(end, len(args) - 1) + 1, max(step, 1)))


def key_table(client_command: Callable[[], Sequence[Any]]) -> KeyTable:
    """The :class:`KeyTable` of the ``COMMAND`` reply that ``client_command()`` returns."""
    return KeyTable(client_command())


def _with_prefix(prefix: bytes, key: Any) -> bytes:
    if isinstance(key, str):
        return prefix + key.encode()
    if isinstance(key, (bytes, bytearray, memoryview)):
        return prefix + bytes(key)
    return prefix + str(key).encode()


def prefixed_command(args: Sequence[Any], prefix: bytes, table: KeyTable) -> tuple[Any, ...]:
    """``args`` with ``prefix`` put before each key argument. An empty key (a script's "none",
    publish.lua) becomes the prefix alone: in the shard's slot, and still no key's name."""
    name = _text(args[0]).upper()
    if name in ("KEYS", "SCAN"):
        return _matching(name, args, prefix)
    positions = table.positions(args)
    if not positions:
        return tuple(args)
    out = list(args)
    for i in positions:
        out[i] = _with_prefix(prefix, out[i])
    return tuple(out)


def _matching(name: str, args: Sequence[Any], prefix: bytes) -> tuple[Any, ...]:
    """``KEYS pattern`` or ``SCAN cursor [MATCH pattern] …`` kept to the shard's keys: its
    pattern prefixed (``{`` and ``}`` are plain characters in Redis' patterns), and a SCAN
    without one given ``MATCH prefix*``."""
    out = list(args)
    if name == "KEYS":
        out[1] = _with_prefix(prefix, out[1])
        return tuple(out)
    words = [_text(a).upper() if isinstance(a, (str, bytes)) else "" for a in out]
    if "MATCH" in words[2:]:
        at = words.index("MATCH", 2) + 1
        out[at] = _with_prefix(prefix, out[at])
    else:
        out += [b"MATCH", prefix + b"*"]
    return tuple(out)


def _strip(prefix: bytes, name: Any) -> Any:
    if isinstance(name, bytes) and name.startswith(prefix):
        return name[len(prefix):]
    text_prefix = prefix.decode()
    if isinstance(name, str) and name.startswith(text_prefix):
        return name[len(text_prefix):]
    return name


def unprefixed(command: str, reply: Any, prefix: bytes) -> Any:
    """``reply`` of ``command`` (one of :data:`KEY_REPLY_COMMANDS`, as Redis sent it) with
    ``prefix`` taken off the key names in it."""
    if reply is None:
        return None
    if command in ("BLPOP", "BRPOP", "BZPOPMIN", "BZPOPMAX"):
        return [_strip(prefix, reply[0]), *reply[1:]]
    if command == "KEYS":
        return [_strip(prefix, k) for k in reply]
    if command == "SCAN":
        return [reply[0], [_strip(prefix, k) for k in reply[1]]]
    if isinstance(reply, dict):  # XREAD in RESP3
        return {_strip(prefix, k): v for k, v in reply.items()}
    return [[_strip(prefix, entry[0]), *entry[1:]] for entry in reply]
