"""Putting a worker's held messages back on their queues at once, with one script call.

At a stop (or when its device hangs) a fast consumer's worker gives back what it holds and has
not finished, as kombu restores an unacknowledged message (marked ``redelivered``), instead of
leaving it for a sweep at its lease's end. Only what is still its own goes back: a message whose
lease lapsed here (a worker frozen, or cut off from Redis, past its lease) went back already and
may be another worker's now; pushed again, it would run twice. A death can be counted against a
request in the same call (one that was on a hung device), as the sweep counts one for a request
on a dead holder's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from asyncinfer.broker.keyspace import keyspace
from asyncinfer.broker.scripts import script
from asyncinfer.wire.keys import (
    DEATHS_PREFIX,
    LEASE_DEVICE_KEY,
    LEASE_HOLDERS_KEY,
    LEASES_KEY,
    RECLAIMED_PREFIX,
    UNACKED_INDEX_KEY,
    UNACKED_KEY,
)

__all__ = ["Restored", "restore"]

_RESTORE = script("restore")
_KEYS = (UNACKED_INDEX_KEY, UNACKED_KEY, LEASES_KEY, LEASE_HOLDERS_KEY, LEASE_DEVICE_KEY)

#: One message to put back: its tag, the list it goes back on, its text as it goes back, and the
#: request ID to count a death against ('' for none).
Restored = tuple[str, str, str, str]


def restore(client: redis.Redis, messages: Sequence[Restored], *, holder: str,
            deaths_ttl_s: int) -> int:
    """Put ``messages`` back that ``holder`` (leases.py's holder name; '' without leases) still
    holds, or that nobody holds and no sweep put back; how many went back."""
    if not messages:
        return 0
    space = keyspace(client)
    args: list[Any] = [holder, space.key(RECLAIMED_PREFIX), space.key(DEATHS_PREFIX),
                       max(1, int(deaths_ttl_s))]
    for tag, list_name, text, request_id in messages:
        args += (tag, space.key(space.name(list_name)), text, request_id)
    return int(client.eval(_RESTORE, len(_KEYS), *_KEYS, *args))
