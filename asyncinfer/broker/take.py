"""Taking waiting messages and recording them as unacknowledged in one atomic step.

A BRPOP (kombu's way) hands a message over before the worker has recorded it in kombu's
``unacked`` bookkeeping: a worker killed in between loses that message. The fast consumer takes
messages only with this script: Redis pops up to ``room`` messages (lists in kombu's priority
order) and records each in ``unacked`` / ``unacked_index`` in the same atomic step, so every
message is at all times either on its queue or in the bookkeeping from which kombu restores it. An
idle consumer waits without popping (wake.py), then takes with this script.

What a take records depends on how its messages come back if their worker dies:

- A **leased** take (the fast consumer's, ``ASYNCINFER_LEASE_S`` > 0) gives its messages back
  through the leases (leases.py), never through kombu's sweep. It reads the few fields it needs
  (delivery tag, request ID, task, eta) from the envelope's text where the text says each
  plainly, as kombu, Celery and this project's producers write them, without decoding the
  envelope (the decode and its checks were half of what a take cost Redis); a text with an escape
  outside its body, its tag or request ID twice, or a redelivered message is decoded as below,
  with the same outcome. A task or eta said twice is read where the text first says it: they
  decide only whether the request's STARTED state is stored (each scan for a second costs Redis
  ~3,000 instructions). It records the message in ``unacked`` (kombu's entry, with no exchange
  and the queue as its routing key: the leases put it back on the list its holder entry names;
  the client's ``whereabouts`` and the lease sweep read it), the leases and their holders, not
  in kombu's ``unacked_index``: kombu's restore sweep, which loads what the index names, never
  meets it. A text that names its tag but is no valid envelope is recorded too; the consumer
  decodes every message, answers it as malformed and acknowledges it under the tag its text
  names.
- An **unleased** take (kombu's channel, ``ASYNCINFER_LEASE_S=0``: kombu's restore sweep is
  the only way back) records only a well-formed envelope: one whose JSON, apart from its (base64)
  body, decodes to an object with ``properties`` (an object with a string ``delivery_tag``),
  ``headers`` (an object, if present), and no deeper nesting than :data:`MAX_ENVELOPE_DEPTH`.
  Anything else is popped but not recorded — the consumer answers it as malformed — so kombu's
  restore sweep (which every worker runs over ``unacked``) never meets a message it cannot load.

The ``unacked`` entry is kombu's ``[envelope, exchange, routing_key]``, the envelope kept byte
for byte.

When the result backend is the broker, the same step stores each request's STARTED state
(Celery's ``task_track_started``), text the worker gives it, so that no second round trip follows
each take; a redelivered request is left to the consumer, which first looks for its stored answer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncinfer.broker.keyspace import PLAIN, Keyspace, keyspace
from asyncinfer.broker.scripts import script
from asyncinfer.wire.keys import (
    BELL_PREFIX,
    LEASE_HOLDERS_KEY,
    LEASES_KEY,
    UNACKED_INDEX_KEY,
    UNACKED_KEY,
    WAITERS_SUFFIX,
    WATCH_PREFIX,
)

__all__ = ["MAX_ENVELOPE_DEPTH", "TAKE_SCRIPT", "LeaseTerms", "StartedText", "Popped", "Taker",
           "parse_taken", "take_args", "take_keys"]

#: Deepest nesting of objects and lists an envelope (outside its body) may have.
MAX_ENVELOPE_DEPTH = 16

_TAKE = script("take")


@dataclass(frozen=True)
class StartedText:
    """What the take stores as the STARTED state of each request it starts: under ``key_prefix``
    + its ID, ``head`` + the ID as JSON + ``tail``, for ``expires_s`` seconds (0: for ever), for
    messages of ``task``."""

    key_prefix: bytes
    head: str
    tail: str
    expires_s: int
    task: str


@dataclass(frozen=True)
class LeaseTerms:
    """How the take leases what it records: for ``lease_s`` seconds (Redis' clock) to ``holder``
    (leases.py), reading the deaths counted under ``deaths_prefix`` + request ID ('' reads none)."""

    lease_s: float
    holder: str
    deaths_prefix: str = ""


#: One entry of a take's reply, a message as popped: list name, message, recorded (0: not; 1: it
#: is; -N: it is, without its body of N bytes, over the largest kept: the message is its envelope
#: alone), STARTED stored, deaths counted against it (the worker wraps each in a ``TakenMessage``).
Popped = tuple[str, bytes, int, bool, int]


def take_keys(lists: Sequence[str], unacked_index: str = UNACKED_INDEX_KEY,
              unacked: str = UNACKED_KEY, watched: Sequence[int] = ()) -> list[str]:
    """The take script's keys for ``lists`` (kombu's bookkeeping under the names given), with
    the watch, bell and count of waiters of each list at a position in ``watched``."""
    keys = [unacked_index, unacked, LEASES_KEY, LEASE_HOLDERS_KEY]
    for position in watched:
        bell = BELL_PREFIX + lists[position]
        keys += (WATCH_PREFIX + lists[position], bell, bell + WAITERS_SUFFIX)
    keys += lists
    return keys


def take_args(room: int, started: StartedText | None = None, lease: LeaseTerms | None = None,
              watcher: str = "", watched: Sequence[int] = (), max_body_bytes: int = 0,
              space: Keyspace = PLAIN) -> list[Any]:
    """The take script's arguments (see :meth:`Taker.take`); ``watched`` as given to
    :func:`take_keys`; the prefixes of the keys the script names itself in ``space``."""
    extra: list[Any] = ["", "", "", 0, ""] if started is None else [
        space.key(started.key_prefix.decode()), started.head, started.tail, started.expires_s,
        started.task]
    terms: list[Any] = [0, "", ""] if lease is None else [
        lease.lease_s, lease.holder, lease.deaths_prefix and space.key(lease.deaths_prefix)]
    return [room, time.time(), MAX_ENVELOPE_DEPTH, *extra, *terms, watcher, len(watched), *watched,
            max(0, int(max_body_bytes or 0))]


def parse_taken(flat: Sequence[Any], space: Keyspace = PLAIN) -> tuple[tuple[int, ...], list[Popped]]:
    """The take script's reply: the positions of the lists whose watch the taker gave up, and
    what it took (its lists named as in ``space``'s Python)."""
    taken = []
    for i in range(1, len(flat), 5):
        taken.append((space.name(flat[i]), flat[i + 1],
                      int(flat[i + 2]), bool(flat[i + 3]), int(flat[i + 4])))
    return (tuple(int(p) for p in flat[0]) if flat else ()), taken


#: The take script's text (kombu's channel sends it on its own connection: broker/atomic_take.py).
TAKE_SCRIPT = _TAKE


class Taker:
    """Runs the take script on the broker ``client``."""

    def __init__(self, client: Any) -> None:
        self._take = client.register_script(_TAKE)
        self._space = keyspace(client)
        #: The positions (in the lists taken from) of the lists whose watch the last take gave
        #: up (the waker claims them again: :meth:`~asyncinfer.broker.wake.Waker.watch_passed`).
        self.passed: tuple[int, ...] = ()

    @property
    def passed_watch(self) -> bool:
        """Whether the last take gave the first list's watch up."""
        return 0 in self.passed

    def take(self, lists: Sequence[str], room: int, started: StartedText | None = None,
             lease: LeaseTerms | None = None, watcher: str = "",
             watched: Sequence[int] = (0,), max_body_bytes: int = 0) -> list[Popped]:
        """Up to ``room`` messages from ``lists`` (in order): ``(list name, message, recorded,
        started, deaths)``, oldest first per list; ``recorded`` is False for a malformed message
        (popped, not recorded as unacknowledged); ``started`` is True when the take stored its
        STARTED state (``started`` given, a request of its task, no eta, not redelivered);
        ``deaths`` the worker deaths counted against its request (``lease`` given). With
        ``lease``, each recorded message is leased to its holder in the same step. With
        ``watcher`` (the :class:`~asyncinfer.broker.wake.Waker`'s token), a take that
        took something passes on the watches of the lists at the positions in ``watched``
        (:meth:`~asyncinfer.broker.wake.Waker.passable`; the first list's bell is the one
        rung for messages a full take left) when others wait for them (wake.py); :attr:`passed`
        says which it gave up. A body over ``max_body_bytes`` (0: any) is left out (see
        :data:`Popped`)."""
        self.passed = ()
        if room <= 0 or not lists:
            return []
        if not watcher:
            watched = ()
        self.passed, taken = parse_taken(self._take(
            keys=take_keys(lists, watched=watched),
            args=take_args(room, started, lease, watcher, watched, max_body_bytes, self._space)),
            self._space)
        return taken
