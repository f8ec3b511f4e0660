"""Storing a batch of results and their acknowledgements with one script call.

Per request the result writer stores the result (SETEX, Celery's layout), announces it (PUBLISH
on the result key's channel, and on the request's reply channel when it names one), and
acknowledges the message (kombu's ``unacked_index`` and ``unacked`` entries removed, and its
lease). As a MULTI/EXEC of five commands a request that is ~12 replies to parse and ~6 commands to
pack in the worker's Python; as one script call per batch it is five arguments. Measured on sim-fast at 256 in
flight: bench/results/HISTORY.md, "The worker's serving CPU cut by a third".

All or nothing, as the transaction was: Redis checks memory (and a replica's read-only state) at a
script's first write, so a refused batch wrote nothing; past the first write the script runs to
its end. The result writes use ``redis.call`` (an error there stops the script: only memory or
read-only can refuse a SET, and both come first); the announcements and acknowledgements use
``redis.pcall``, so one odd key (a user's value of another type where an ``unacked`` hash should
be) is reported and the rest still done, as EXEC reports one failed command and runs the others.

A *guarded* entry (a sequence request's: its state lives on one worker) never replaces a final
state (SUCCESS, FAILURE, REVOKED) already stored for its request: a worker frozen or cut off past
its lease finishes, once it is back, requests that another worker's sweep already failed with
SequenceStateLost (worker/requests/sequence_pins.py), and that failure is what its caller was told.
The script leaves such a result out (still acknowledging the message) and names its key, so the
worker drops the state the request left (engine/sequences.py). A plain request's result is
stored as ever (a request that ran again after a reclaim stores its answer).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis

from asyncinfer.broker.keyspace import keyspace
from asyncinfer.broker.scripts import script
from asyncinfer.wire.keys import (
    LEASE_DEVICE_KEY,
    LEASE_HOLDERS_KEY,
    LEASES_KEY,
    TRACES_KEY,
    UNACKED_INDEX_KEY,
    UNACKED_KEY,
)

__all__ = ["GUARDED", "QUIET", "Entry", "StoreScript", "as_out_of_memory", "error_texts",
           "execute_writes", "log_refusals", "store_reply"]

log = logging.getLogger(__name__)

#: One request's part of a batch: result key ('' for none), stored text, reply channel ('' for
#: none), delivery tag ('' when it was never recorded as unacknowledged), guard (:data:`GUARDED`:
#: never replace a final state stored for the request; :data:`QUIET`: store it, announce nothing;
#: '': store and announce as ever).
Entry = tuple[str, Any, str, str, str]

#: An entry's guard: its result never replaces a final state already stored (a sequence request).
GUARDED = "1"
#: An entry's guard: stored, not announced (a STARTED state: waiters act on final states only).
QUIET = "q"

_STORE = script("store")


#: The keys the store script writes: kombu's bookkeeping, then the leases' (leases.py).
_KEYS = (UNACKED_INDEX_KEY, UNACKED_KEY, LEASES_KEY, LEASE_HOLDERS_KEY, LEASE_DEVICE_KEY,
         TRACES_KEY)


class StoreScript:
    """The store script, registered on one Redis client."""

    def __init__(self, client: redis.Redis, expires_s: int, holder: str = "") -> None:
        self._script = client.register_script(_STORE)
        #: The result keys go in ARGV: named as Redis holds them (keyspace.py).
        self._space = keyspace(client)
        self.expires_s = expires_s
        #: The lease holder acknowledging (leases.py's holder name): a tag another holder took
        #: since is left to it ('': acknowledge whoever holds).
        self.holder = holder

    def __call__(self, entries: Sequence[Entry], client: Any = None,
                 untraced: Sequence[str] = ()) -> list[str]:
        """Store ``entries``; with ``client`` a pipeline, queue it there (its reply is the
        script's: see :func:`store_reply`); remove the traces of ``untraced`` (request IDs whose
        result this call or an earlier one stores). The error replies (as text) of the
        announcements and acknowledgements."""
        return self.call(entries, client, untraced)[0]

    def call(self, entries: Sequence[Entry], client: Any = None,
             untraced: Sequence[str] = ()) -> tuple[list[str], list[str]]:
        """:meth:`__call__`, and the result keys of the guarded entries left out (a final state
        was stored already)."""
        try:
            reply = self._script(keys=list(_KEYS), args=self._args(entries, untraced),
                                 client=client)
        except redis.ResponseError as exc:
            raise as_out_of_memory(exc) from None
        errors, skipped = store_reply(reply)
        return errors, [self._space.name(key) for key in skipped]

    def queue(self, pipe: Any, entries: Sequence[Entry], untraced: Sequence[str] = ()) -> None:
        """Add the call to ``pipe`` (a plain pipeline) as a bare EVALSHA, without the existence
        check redis-py's pipelines make per execute: its reply is a ``NoScriptError`` when Redis
        has not loaded the script (a restarted or new master); :meth:`load` it then."""
        pipe.evalsha(self._script.sha, len(_KEYS), *_KEYS, *self._args(entries, untraced))

    def _args(self, entries: Sequence[Entry], untraced: Sequence[str] = ()) -> list[Any]:
        args: list[Any] = [self.expires_s, self.holder, len(untraced), *untraced]
        space = self._space
        if space.prefix:
            for key, value, reply_to, tag, guard in entries:
                args += (space.key(key) if key else "", value, reply_to, tag, guard)
            return args
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


def store_reply(reply: Any) -> tuple[list[str], list[str]]:
    """The store script's reply as (its error replies, the result keys it left out), as text;
    ([], []) for a queued call's pipeline."""
    if not isinstance(reply, list) or len(reply) != 2:
        return [], []
    errors, skipped = reply
    return error_texts(errors), error_texts(skipped)


def as_out_of_memory(exc: redis.ResponseError) -> redis.ResponseError:
    """``exc``, as the OutOfMemoryError it is when a script's write met a full Redis (Redis 6
    reports it as ``ERR Error running script ... -OOM ...``; Redis 7 with its own code)."""
    if not isinstance(exc, redis.OutOfMemoryError) and "-OOM " in str(exc):
        return redis.OutOfMemoryError(str(exc))
    return exc


def execute_writes(pipe: Any, stored: bool) -> list[str]:
    """EXEC a transaction of result writes. A refusal before EXEC (out of memory, read-only:
    nothing was written) raises, to be tried again; an error reply of one command inside it (all
    others done) is logged, as trying again would repeat the others. With ``stored`` (the store
    script is its last command), the result keys the store left out."""
    replies = pipe.execute(raise_on_error=False)
    left: list[str] = []
    for i, reply in enumerate(replies):
        if isinstance(reply, redis.ResponseError):
            if isinstance(as_out_of_memory(reply), redis.OutOfMemoryError):
                raise as_out_of_memory(reply)  # the script refused at its first write
            log.error("a result write was refused by Redis: %s", reply)
        elif stored and i == len(replies) - 1:
            errors, left = store_reply(reply)
            left = [keyspace(pipe).name(key) for key in left]
            log_refusals(errors)
        else:
            log_refusals(error_texts(reply))
    return left


def log_refusals(errors: list[str]) -> None:
    """Log each error reply of a result write."""
    for error in errors:
        log.error("a result write was refused by Redis: %s", error)
