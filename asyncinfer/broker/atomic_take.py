"""Taking in kombu's Redis channel with the fast consumer's atomic take, not BRPOP.

kombu's channel pops a message with BRPOP and records it in its ``unacked`` bookkeeping one round
trip later: a worker killed in between loses that message. With ``atomic_take`` (a transport
option; every worker turns it on at start, asyncinfer/worker/bootstrap.py) the project's channel takes as
the fast consumer does (asyncinfer/broker/take.py): one script pops what is waiting, up to
the prefetch room, and records each message in kombu's ``unacked`` hash and ``unacked_index`` in
the same atomic step; an idle channel (its last take popped fewer than it asked for: the lists
were empty) waits without popping (``BLMOVE list list RIGHT RIGHT``, a no-op move of a list's
tail onto itself) and takes again when it returns. So a message is at all
times either on its queue or in the bookkeeping from which kombu restores it.

Both commands go out on kombu's own poll connection, through kombu's event loop, in place of the
BRPOP: the reply of a take is delivered message by message as kombu delivers a BRPOP's (kombu's
QoS then keeps the rest of its bookkeeping, without writing the record again). Redis blocks one
connection on one list only: the wait is on the channel's first list (its first queue's main
list), for at most :attr:`AtomicTake.take_wait_s`, after which it takes from every list again — a
message on another list (a priority list, a second queue) of an idle channel waits up to that long.
An idle channel so wakes about ten times a second: 0.55 % of a core for an idle stock worker here,
against 0.15 % with BRPOP's one-second wait. A channel that reads only queues where no task is served
(the control queue of Celery's consumer beside the fast consumer, a remote-control reply queue)
waits :attr:`AtomicTake.control_wait_s` instead, BRPOP's second, and its leases do not sweep (the
fast consumer's do, for the worker): their takes and sweeps were half of what an idle device
worker cost Redis.
"""

from __future__ import annotations

import math
import time
from typing import Any

from kombu.transport.virtual import base as virtual
from kombu.utils.encoding import bytes_to_str
from redis import exceptions

from asyncinfer.constants import serves_no_task
from asyncinfer.wire.envelope import tag_in

__all__ = ["AtomicTake"]

_WAIT, _TAKE = "BLMOVE", "EVALSHA"


class AtomicTake:
    """The atomic take of :class:`asyncinfer.broker.transport.Channel` (mixed into it)."""

    #: Take with the atomic script instead of BRPOP (transport option ``atomic_take``).
    atomic_take = False
    #: Longest wait of an idle channel on its first list before it takes from all again (seconds;
    #: transport option ``take_wait_s``).
    take_wait_s = 0.1
    #: The same, for a channel that reads only queues where no task is served.
    control_wait_s = 1.0
    #: Lease what it takes for this long (seconds, Redis' clock; 0: no leases), to a holder named
    #: after this worker (transport options ``lease_s`` and ``lease_node``): the channel renews
    #: the leases of what it holds and sweeps expired ones (broker/leases.py).
    lease_s = 0.0
    lease_node = ""
    #: Count a worker death against each request on the device when it dies (its batches are
    #: marked by the pipeline that runs them: worker/consumers/kombu_intake.py), kept this many
    #: seconds (transport options ``lease_deaths`` and ``lease_deaths_ttl_s``).
    lease_deaths = False
    lease_deaths_ttl_s = 86400.0
    #: The largest message body taken whole, in bytes of its text (transport option
    #: ``max_body_bytes``; 0: any): a larger one is taken without it, for its consumer to refuse.
    max_body_bytes = 0
    #: The transport options above.
    OPTIONS = ("atomic_take", "take_wait_s", "lease_s", "lease_node", "lease_deaths",
               "lease_deaths_ttl_s", "max_body_bytes")

    _leases: Any = None
    #: Delivery tag → the worker deaths the take read for its request (those with any), until the
    #: pipeline that receives the message takes the count (:meth:`deaths_of`).
    _deaths: dict[str, int] | None = None
    #: Delivery tag → the bytes of its body the take left out (over ``max_body_bytes``), until its
    #: consumer reads it (:meth:`body_cut_of`).
    _cut: dict[str, int] | None = None

    _take_next = _TAKE
    _take_sent = ""
    _take_sha = ""
    #: How many messages the take in flight may pop.
    _take_room = 1
    #: The non-popping wait: BLMOVE (Redis 6.2+), else BRPOPLPUSH (which moves the oldest message
    #: to the front of its list: the order of that one message changes, it is never lost).
    _wait_command = _WAIT

    def _takes_atomically(self) -> bool:
        return bool(self.atomic_take) and not self.global_keyprefix  # type: ignore[attr-defined]

    def _take_start(self) -> None:
        """Send the take (or, once a take left every list empty, the wait) on the poll
        connection, where kombu sends its BRPOP."""
        from asyncinfer.broker.keyspace import keyspace
        from asyncinfer.broker.take import TAKE_SCRIPT, take_args, take_keys

        ch: Any = self
        queues = ch._queue_cycle.consume(len(ch.active_queues))
        if not queues:
            return
        lists = [ch._q_for_pri(q, pri) for pri in ch.priority_steps for q in queues]
        control_only = all(serves_no_task(q) for q in queues)
        if not self._take_sha:
            self._take_sha = ch.client.script_load(TAKE_SCRIPT)
        if self._take_next == _WAIT:
            first = lists[0]
            wait_s = self.control_wait_s if control_only else self.take_wait_s
            if self._wait_command == _WAIT:
                args: tuple[Any, ...] = (_WAIT, first, first, "RIGHT", "RIGHT", wait_s)
            else:
                args = ("BRPOPLPUSH", first, first, max(1, math.ceil(wait_s)))
        else:
            room = self._take_room = ch.qos.can_consume_max_estimate() or 1
            keys = take_keys(lists, ch.unacked_index_key, ch.unacked_key)
            args = (_TAKE, self._take_sha, len(keys), *keys,
                    *take_args(room, lease=self._lease_terms(control_only),
                               max_body_bytes=int(self.max_body_bytes or 0),
                               space=keyspace(ch.client)))
        connection = ch.client.connection
        ch._in_poll = connection
        ch._brpop_sent_at = time.monotonic()
        self._take_sent = args[0]
        connection.send_command(*args)

    def _lease_terms(self, control_only: bool) -> Any:
        """The lease terms of this channel's takes (its leases started on first use); None
        without leases. With ``lease_deaths`` the take reads each redelivered request's deaths,
        and a death counts against what the pipeline marked on the device. A
        channel that reads only queues where no task is served (beside a fast consumer, whose
        leases sweep for the worker) renews what it holds and does not sweep."""
        if not self.lease_s:
            return None
        if self._leases is None:
            from asyncinfer.broker.leases import Leases

            ch: Any = self
            self._leases = Leases(ch._create_client(), ch._create_client(),
                                  node=self.lease_node or "celery", lease_s=float(self.lease_s),
                                  deaths_ttl_s=float(self.lease_deaths_ttl_s),
                                  count_deaths=bool(self.lease_deaths),
                                  held=lambda: list(ch.qos._delivered.copy())).start()
        # Decided at every take: Celery's consumer adds its queues one by one, so a channel's
        # first take may see only the control queue.
        self._leases.sweeps(not control_only)
        return self._leases.terms

    @property
    def leases(self) -> Any:
        """This channel's leases (broker/leases.py), None before its first take or without."""
        return self._leases

    def deaths_of(self, tag: str) -> int:
        """The worker deaths counted against the request of the message ``tag`` when it was taken
        (read once: the count is forgotten here)."""
        return self._deaths.pop(tag, 0) if self._deaths else 0

    def body_cut_of(self, tag: str) -> int:
        """The bytes of the body of message ``tag`` that the take left out (0: none; read once)."""
        return self._cut.pop(tag, 0) if self._cut else 0

    def _stop_leases(self) -> None:
        if self._leases is not None:
            self._leases.stop()
            self._leases = None

    def _take_reply(self, **options: Any) -> list[tuple[str, Any, int, int]]:
        """The reply of what :meth:`_take_start` sent: what a take took, as ``(queue, message,
        recorded, deaths)`` (``recorded`` as in broker/take.py's ``Popped``); Empty when it took
        nothing (or it was the wait)."""
        ch: Any = self
        sent, self._take_sent = self._take_sent, ""
        try:
            reply = ch.client.parse_response(ch.client.connection, sent, **options)
        except exceptions.NoScriptError:  # Redis restarted or flushed its scripts: load again
            self._take_sha, self._take_next = "", _TAKE
            raise virtual.Empty() from None
        except exceptions.ResponseError as exc:
            if sent != _WAIT or "unknown command" not in str(exc).lower():
                raise
            self._wait_command = "BRPOPLPUSH"  # Redis before 6.2
            raise virtual.Empty() from None
        if sent != _TAKE:
            self._take_next = _TAKE  # something came, or the wait is over: take from all lists
            raise virtual.Empty()
        from asyncinfer.broker.keyspace import keyspace
        from asyncinfer.broker.take import parse_taken

        taken = [(bytes_to_str(key).rsplit(ch.sep, 1)[0], raw, recorded, int(died))
                 for key, raw, recorded, _, died in parse_taken(reply or (),
                                                                keyspace(ch.client))[1]]
        # fewer than it asked for: the lists are empty, it waits (the room grew meanwhile, as
        # acknowledgements came, says nothing of the lists)
        self._take_next = _TAKE if len(taken) >= self._take_room else _WAIT
        if not taken:
            raise virtual.Empty()
        return taken

    def _took(self, queue: str, raw: Any, recorded: int, died: int = 0) -> None:
        """Deliver one message a take popped; its record is not written again. One that breaks
        the rules (the fast consumer's are stricter than the script's) is answered and leaves
        the bookkeeping; one the script did not record is delivered as kombu delivers a BRPOP's."""
        ch: Any = self
        ch._queue_cycle.rotate(queue)
        envelope = ch._checked(raw, queue)
        if envelope is None:
            tag = tag_in(raw) if recorded else ""
            if tag:
                ch.qos._remove_from_indices(tag).execute()
            return
        tag = envelope["properties"]["delivery_tag"]
        if died:
            if self._deaths is None:
                self._deaths = {}
            self._deaths[tag] = died
        if recorded < 0:  # its body was left out: refused for its size (worker/celery_consumer.py)
            if self._cut is None:
                self._cut = {}
            self._cut[tag] = -recorded
        if recorded:
            ch.qos.recorded.add(tag)
        try:
            delivered = ch._deliver(envelope, queue, raw=raw)
            if recorded and (not delivered or tag not in ch.qos._delivered):
                # answered as malformed, or taken by a consumer that does not acknowledge
                # (no_ack: remote control's replies, say): out of the bookkeeping
                ch.qos._remove_from_indices(tag).execute()
        finally:
            ch.qos.recorded.discard(tag)
