"""Whether anything exists for a request ID in Redis: a mistyped ID is said at once.

``Client.result(id)`` (and ``asyncinfer result ID``) waits for a request's answer; for an ID that
nothing exists for it used to wait out the whole timeout (60 s in the CLI) and only then say "no
request with this ID is known". What a request leaves in Redis, from its push to its answer, and
where a look reads, in this order:

1. its trace (``asyncinfer:request:<id>``, keys.py: written with the push by every asyncinfer
   client and never deleted while its result may be stored), its death count, its stored result
   (any state: STARTED is stored when a worker takes it) and its stream: one EXISTS each;
2. every list of the broker (the queues, their priority lists, the workers' own lists of
   sequences, the CPU stages' queue, dead letters; not the wake-up bells), from the head (the
   newest) in chunks. An entry is it when it holds the ID in its text or in its decoded body: a
   staged chain names its last task's ID only in the body of its first message;
3. kombu's unacknowledged bookkeeping (what workers took and hold, those held for an eta too) and
   the leases' marks of what is on a device;
4. its result and stream again: a request moves forward from queue to taken to stored, so one
   that moved while steps 2-3 read is found at a later step.

Requests of other producers (Celery's ``send_task``, ``redis-cli``) have no trace, so the lists are
searched; nothing has an index of them, and LPOS would need the entry's exact bytes. The search is
bounded: a look that would read more than :attr:`Limits.max_entries` entries or
:attr:`Limits.max_bytes` bytes, or whose scan of the keyspace for lists takes more than
:attr:`Limits.max_scans` SCAN calls, says nothing (``whole`` is False) and the caller waits as
before. So does a failed read, a broker that is not Redis (RabbitMQ: its queues cannot be read) and
an entry whose body is compressed. The caller looks twice, :data:`LOOK_GAP_S` apart, before it says
an ID is unknown, so a message between two places (popped and not yet recorded, given back to its
queue) is not missed.
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from asyncinfer.errors import RequestUnknown
from asyncinfer.wire.keys import (
    BELL_PREFIX,
    CLAIM_PREFIX,
    DEATHS_PREFIX,
    LEASE_DEVICE_KEY,
    STREAM_PREFIX,
    TRACES_KEY,
    UNACKED_KEY,
)

__all__ = ["LOOK_GAP_S", "Limits", "Look", "look_up", "unknown_error", "refuse_unknown"]

#: Seconds between the two looks that must both find nothing before an ID is said unknown.
LOOK_GAP_S = 1.0


@dataclass(frozen=True)
class Limits:
    """What one look reads at most."""

    #: List and bookkeeping entries read.
    max_entries: int = 5000
    #: Their bytes.
    max_bytes: int = 32 * 1024 * 1024
    #: SCAN calls (``COUNT`` :attr:`scan_count` each) to find the broker's lists.
    max_scans: int = 100
    scan_count: int = 10000
    #: Entries read per LRANGE or HSCAN.
    chunk: int = 500


@dataclass(frozen=True)
class Look:
    """What a look found: where something for the ID is (``found``), and whether it read every
    place whole (``whole``; False: a limit stopped it, or a place could not be read)."""

    found: str = ""
    whole: bool = True

    @property
    def unknown(self) -> bool:
        """Nothing exists for the ID: every place was read, nothing found."""
        return not self.found and self.whole


@dataclass
class _Budget:
    limits: Limits
    entries: int = 0
    size: int = 0
    #: A limit was reached or something could not be read: the look is not whole.
    short: bool = False
    #: The ID as an entry may hold it (:func:`_needles_of`).
    needles: tuple[bytes, ...] = ()

    def room(self) -> int:
        """Entries that may still be read (0 once a limit is reached)."""
        if self.size >= self.limits.max_bytes:
            return 0
        return max(0, self.limits.max_entries - self.entries)

    def read(self, entries: list[bytes]) -> None:
        self.entries += len(entries)
        self.size += sum(len(e) for e in entries)


def look_up(request_id: str, results: Any, backend: Any, broker: Any | None,
            limits: Limits = Limits()) -> Look:
    """Where anything for ``request_id`` is, read from Redis within ``limits``.

    ``results`` is the result backend's Redis client, ``backend`` Celery's result backend (its
    key for a request), ``broker`` the Redis broker's client (None: not a Redis broker, whose
    queues cannot be read: the look is not whole). Redis errors go to the caller.
    """
    found = _keys(request_id, results, backend, broker)
    if found:
        return Look(found)
    if broker is None:
        return Look(whole=False)
    budget = _Budget(limits, needles=_needles_of(request_id))
    found = _lists(broker, budget) or _taken(request_id, broker, budget)
    if found:
        return Look(found)
    if budget.short:
        return Look(whole=False)
    return Look(_keys(request_id, results, backend, broker))


def unknown_error(request_id: str, gap_s: float) -> RequestUnknown:
    """The error of an ID that nothing exists for."""
    return RequestUnknown(
        f"request {request_id}: no request with this ID is known: nothing exists for it in Redis "
        f"(no result, trace, claim, queue entry, unacked entry, lease or stream; looked twice, "
        f"{gap_s:g} s apart); check the ID")


def refuse_unknown(request_id: str, look: Callable[[], Look], future: concurrent.futures.Future[Any],
                   gap_s: float = LOOK_GAP_S) -> None:
    """Raise :class:`~asyncinfer.errors.RequestUnknown` when two looks ``gap_s`` apart find
    nothing for ``request_id`` and its ``future`` did not end between them; return at once when
    the first finds something (or cannot tell: a look that fails tells nothing)."""
    if not _unknown(look):
        return
    done, _ = concurrent.futures.wait([future], timeout=gap_s)
    if done or not _unknown(look):
        return
    raise unknown_error(request_id, gap_s)


def _unknown(look: Callable[[], Look]) -> bool:
    try:
        return look().unknown
    except (redis.RedisError, OSError):
        return False


def _keys(request_id: str, results: Any, backend: Any, broker: Any | None) -> str:
    """Which of the request's own keys exist: stored result or stream, trace or death count."""
    if results.exists(backend.get_key_for_task(request_id), STREAM_PREFIX + request_id):
        return "its stored result or stream"
    if broker is not None and (broker.exists(CLAIM_PREFIX + request_id, DEATHS_PREFIX + request_id)
                               or broker.hexists(TRACES_KEY, request_id)):
        return "its trace (claim)"
    return ""


def _lists(broker: Any, budget: _Budget) -> str:
    """The first list of the broker with an entry for the ID (newest first), within the budget."""
    keys: list[bytes] = []
    cursor = 0
    for _ in range(budget.limits.max_scans):
        cursor, batch = broker.scan(cursor, count=budget.limits.scan_count, _type="list")
        keys += batch
        if not int(cursor):
            break
    else:
        budget.short = True  # a keyspace too large to scan in one look
        return ""
    for key in sorted(_bytes(k) for k in keys):
        if key.startswith(BELL_PREFIX.encode()):
            continue
        length = int(broker.llen(key))
        for start in range(0, length, budget.limits.chunk):
            room = budget.room()
            if not room:
                budget.short = True
                return ""
            entries = [_bytes(e) for e in
                       broker.lrange(key, start, start + min(room, budget.limits.chunk) - 1)]
            budget.read(entries)
            for entry in entries:
                if _names(entry, budget):
                    return f"an entry of the list {key.decode(errors='replace')}"
    return ""


def _taken(request_id: str, broker: Any, budget: _Budget) -> str:
    """Whether a worker holds it: kombu's unacknowledged entries, the leases' device marks."""
    if int(broker.hlen(UNACKED_KEY)) > budget.room():
        budget.short = True
        return ""
    for tag, entry in broker.hscan_iter(UNACKED_KEY, count=budget.limits.chunk):
        budget.read([_bytes(entry)])
        if _names(_bytes(entry), budget):
            return f"kombu's unacknowledged entry {_bytes(tag).decode(errors='replace')}"
    marks = [_bytes(m) for m in broker.hvals(LEASE_DEVICE_KEY)]
    budget.read(marks)
    if request_id.encode() in marks:
        return "a lease's device mark"
    if budget.entries > budget.limits.max_entries:
        budget.short = True  # the hash grew while it was read
    return ""


def _needles_of(request_id: str) -> tuple[bytes, ...]:
    """The ID's bytes as an entry may hold them: raw (msgpack, a decoded body) and as JSON
    writes it (escaped)."""
    raw = request_id.encode()
    escaped = json.dumps(request_id)[1:-1].encode()
    return (raw,) if escaped == raw else (raw, escaped)


def _names(entry: bytes, budget: _Budget) -> bool:
    """Whether a queue or unacknowledged entry holds the ID: in its text, or in its body
    decoded (kombu's base64). A body that cannot be read (compressed) makes the look short."""
    if any(n in entry for n in budget.needles):
        return True
    try:
        doc = json.loads(entry)
    except ValueError:
        return False  # not kombu's envelope: its text was searched
    message = doc[0] if isinstance(doc, list) and doc else doc
    if not isinstance(message, dict):
        return False
    headers = message.get("headers")
    properties = message.get("properties")
    if isinstance(headers, dict) and headers.get("compression"):
        budget.short = True
        return False
    body = message.get("body")
    if not (isinstance(properties, dict) and properties.get("body_encoding") == "base64"
            and isinstance(body, str)):
        return False
    try:
        decoded = base64.b64decode(body)
    except (binascii.Error, ValueError):
        budget.short = True
        return False
    return any(n in decoded for n in budget.needles)


def _bytes(value: bytes | str) -> bytes:
    """A reply as bytes, whether or not the client decodes responses."""
    return value if isinstance(value, bytes) else value.encode()
