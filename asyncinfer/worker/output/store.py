"""Storing a batch of results and their acknowledgements with one script call.

Per request the result writer stores the result (SETEX, Celery's layout), announces it (PUBLISH
on the result key's channel, and on the request's reply channel when it names one), and
acknowledges the message (kombu's ``unacked_index`` and ``unacked`` entries removed, and its
lease). As a MULTI/EXEC of five commands a request that is ~12 replies to parse and ~6 commands to
pack in the worker's Python; as one script call per batch it is four arguments. Measured on sim-fast at 256 in
flight: see docs/benchmarks.md.

All or nothing, as the transaction was: Redis checks memory (and a replica's read-only state) at a
script's first write, so a refused batch wrote nothing; past the first write the script runs to
its end. The result writes use ``redis.call`` (an error there stops the script: only memory or
read-only can refuse a SET, and both come first); the announcements and acknowledgements use
``redis.pcall``, so one odd key (a user's value of another type where an ``unacked`` hash should
be) is reported and the rest still done, as EXEC reports one failed command and runs the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from asyncinfer.keys import (
    LEASE_DEVICE_KEY,
    LEASE_HOLDERS_KEY,
    LEASES_KEY,
    UNACKED_INDEX_KEY,
    UNACKED_KEY,
)
from asyncinfer.scripts import script

__all__ = ["Entry", "StoreScript", "as_out_of_memory", "error_texts"]

#: One request's part of a batch: result key ('' for none), stored text, reply channel ('' for
#: none), delivery tag ('' when it was never recorded as unacknowledged).
Entry = tuple[str, Any, str, str]

_STORE = script("store")


#: The keys the store script writes: kombu's bookkeeping, then the leases' (leases.py).
_KEYS = (UNACKED_INDEX_KEY, UNACKED_KEY, LEASES_KEY, LEASE_HOLDERS_KEY, LEASE_DEVICE_KEY)


class StoreScript:
    """The store script, registered on one Redis client."""

    def __init__(self, client: redis.Redis, expires_s: int) -> None:
        self._script = client.register_script(_STORE)
        self.expires_s = expires_s

    def __call__(self, entries: Sequence[Entry], client: Any = None) -> list[str]:
        """Store ``entries``; with ``client`` a pipeline, queue it there (its reply is the list
        of errors). The error replies (as text) of the announcements and acknowledgements."""
        try:
            errors = self._script(keys=list(_KEYS), args=self._args(entries),
                                  client=client)
        except redis.ResponseError as exc:
            raise as_out_of_memory(exc) from None
        return error_texts(errors)

    def queue(self, pipe: Any, entries: Sequence[Entry]) -> None:
        """Add the call to ``pipe`` (a plain pipeline) as a bare EVALSHA, without the existence
        check redis-py's pipelines make per execute: its reply is a ``NoScriptError`` when Redis
        has not loaded the script (a restarted or new master); :meth:`load` it then."""
        pipe.evalsha(self._script.sha, len(_KEYS), *_KEYS, *self._args(entries))

    def _args(self, entries: Sequence[Entry]) -> list[Any]:
        args: list[Any] = [self.expires_s]
        for entry in entries:
            args += entry
        return args

    def load(self, client: redis.Redis) -> None:
        """Load the script into ``client``'s Redis."""
        self._script.sha = client.script_load(self._script.script)


def error_texts(reply: Any) -> list[str]:
    """The script's reply (a list of error replies) as text; [] for a queued call's pipeline."""
    if not isinstance(reply, list):
        return []
    return [e.decode(errors="replace") if isinstance(e, bytes) else str(e) for e in reply]


def as_out_of_memory(exc: redis.ResponseError) -> redis.ResponseError:
    """``exc``, as the OutOfMemoryError it is when a script's write met a full Redis (Redis 6
    reports it as ``ERR Error running script ... -OOM ...``; Redis 7 with its own code)."""
    if not isinstance(exc, redis.OutOfMemoryError) and "-OOM " in str(exc):
        return redis.OutOfMemoryError(str(exc))
    return exc
