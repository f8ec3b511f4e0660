"""The shards of a Redis Cluster the fleet's keys go in: their hash tags.

A cluster URL (urls.py: ``rediscluster://host:port/?nodes=host:port&shards=3&shard=1``) names one
shard of several. Shard ``i`` of ``shards`` is one hash slot: each of its keys starts with the
hash tag ``{<i>.<n>}`` (cluster_keys.py), where ``n`` is the first number that puts the tag's slot
in the ``i``-th of ``shards`` equal ranges of the 16,384 slots. A cluster whose masters own equal
ranges of slots (as ``redis-cli --cluster create`` makes them) so holds ``shards / masters``
shards on each master, and a resharding moves a shard with its slot. Everything of a request
(its queue entry, lease, result, stream, idempotency claim) is in its URL's shard, so every step
of it stays one script on one slot.
"""

from __future__ import annotations

from functools import lru_cache

from redis.crc import key_slot

__all__ = ["SLOTS", "DEFAULT_SHARDS", "shard_tags", "key_prefix", "tag_slot", "request_shard"]

#: Redis Cluster's hash slots.
SLOTS = 16384
#: Shards of a cluster URL that names none: one, on one master of the cluster. A URL names one
#: shard (``shard=K`` of ``shards=N``: the routing table puts groups of models on shards of their
#: own, and so on masters of their own), or spreads every model over all N (``shards=N`` alone:
#: one model on every master).
DEFAULT_SHARDS = 1


@lru_cache(maxsize=16)
def shard_tags(shards: int) -> tuple[str, ...]:
    """The hash tag (without its braces) of each of ``shards`` shards."""
    if not 1 <= shards <= SLOTS:
        raise ValueError(f"a cluster's shards must be 1 to {SLOTS}, got {shards}")
    tags = []
    for i in range(shards):
        low, high = i * SLOTS // shards, (i + 1) * SLOTS // shards
        n = 0
        while not low <= tag_slot(f"{i}.{n}") < high:
            n += 1
        tags.append(f"{i}.{n}")
    return tuple(tags)


def tag_slot(tag: str) -> int:
    """The hash slot of the keys that carry ``tag``."""
    return int(key_slot(tag.encode()))


def key_prefix(tag: str) -> bytes:
    """What each key of the shard tagged ``tag`` starts with."""
    return b"{" + tag.encode() + b"}"



def request_shard(request_id: str, shards: int) -> int:
    """The shard of ``shards`` that request ``request_id`` lives on when a URL spreads requests:
    the one whose slot range holds the slot its ID hashes to (as a key named by the ID would), so
    any process finds a request's queue entry, result and stream from its ID alone, and IDs
    (random) fall on the shards evenly."""
    return int(key_slot(request_id.encode())) * shards // SLOTS if shards > 1 else 0
