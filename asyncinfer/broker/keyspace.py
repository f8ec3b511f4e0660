"""Key names where Python and a script meet, on a Redis Cluster shard as on one Redis.

A shard's client (cluster_client.py) puts the shard's hash tag before every key *argument* of a
command, a script's ``KEYS`` included, and takes it off the key names its replies carry. A key
name that travels another way is the code's to place: one in a script's ``ARGV`` (a result key,
the prefix of the death counts that a script appends a request ID to), a key a script returns in
its reply, a list named inside a value that a script reads back (a lease holder's entry). Python
deals in plain names; :meth:`Keyspace.key` gives a script the name Redis holds, and
:meth:`Keyspace.name` turns one back. On one Redis both are the name itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Keyspace", "keyspace", "PLAIN"]


@dataclass(frozen=True)
class Keyspace:
    """The key names of one Redis, or of one shard of a cluster (``prefix``, its hash tag)."""

    prefix: str = ""

    def key(self, name: str | bytes) -> Any:
        """The name Redis holds for ``name`` (for a script's ``ARGV``), of its type."""
        if not self.prefix:
            return name
        return self.prefix.encode() + name if isinstance(name, bytes) else self.prefix + name

    def name(self, key: str | bytes) -> str:
        """``key`` as Redis holds it (a script's reply, a value), as Python names it."""
        text = key.decode() if isinstance(key, bytes) else key
        if self.prefix and text.startswith(self.prefix):
            return text[len(self.prefix):]
        return text


#: One Redis: names are keys.
PLAIN = Keyspace()


def keyspace(client: Any) -> Keyspace:
    """The keyspace of ``client`` (a redis-py client or pipeline): a shard's, by the tag its
    connections put before keys; else :data:`PLAIN`."""
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None) or {}
    prefix = getattr(kwargs.get("command_packer"), "prefix", b"")
    return Keyspace(prefix.decode()) if isinstance(prefix, bytes) and prefix else PLAIN
