"""kombu's Redis transport keeping the promises the project's fast consumer keeps.

Every Celery consumer of the app on a Redis broker uses it: ``ASYNCINFER_CONSUMER=celery``, the
prefork pool, the ``asyncinfer.cpu`` stage workers, and the Celery consumer inside a device worker
(its control queue, mingle, gossip, kombu's restore sweep); the app's connections pick it
(:mod:`asyncinfer.broker.kombu_connection`). It is kombu's own transport (``kombu.transport.redis``,
whose own tests it passes: tests/integration/test_kombu_upstream.py) with four things changed:

- **A queue is an open door.** Whatever is pushed on a queue (``LPUSH infer.mlp "{not json"``) is
  checked by the same rules as the fast consumer's (:func:`~asyncinfer.wire.envelope.parse_envelope`)
  before kombu sees it. A message that breaks them is dropped with a log line and, when its text
  names a request ID, that request gets a FAILURE naming it and the rule
  (:func:`~asyncinfer.wire.envelope.malformed_error`), stored through :attr:`Transport.on_malformed`
  (the Celery consumer sets it). kombu would end the worker ("Unrecoverable error").
- **Redis' refusals are not the end.** ``MISCONF`` (a full disk), ``OOM``, ``READONLY``,
  ``NOSCRIPT``, ``BUSY``, ``LOADING`` (:mod:`asyncinfer.broker.refusals`) are connection errors
  here, so Celery reconnects instead of ending the worker; the consuming BRPOP, kombu's
  bookkeeping of a message it popped and an acknowledgement ride them out in place with backoff,
  logging Redis' reason. A ``PING`` refused under ``MISCONF`` counts as an answer (the server is
  there), so a channel opens while the disk is full and consumes once it is not.

- **A kill at any moment loses nothing.** With the transport option ``atomic_take`` (a worker
  sets it) a message is popped and recorded in kombu's bookkeeping in one atomic step, by the
  fast consumer's take script (:mod:`asyncinfer.broker.atomic_take`), instead of BRPOP and a record one
  round trip later.

- **A freed slot is taken at once.** An acknowledgement from another thread (the pipeline's
  writer) of a channel whose prefetch window was full wakes kombu's event loop
  (:attr:`Transport.event_loop`), which takes again in its next turn; kombu's loop would sleep in
  its poll until something else woke it, the device running dry meanwhile and a high-priority
  message waiting in Redis behind the window's low ones.

Without ``atomic_take``, a message BRPOP popped whose bookkeeping Redis refused (``OOM``) is held
in memory and recorded again before the next BRPOP; like kombu's own gap between a BRPOP and its
bookkeeping, a kill in that time loses it.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import base as virtual
from kombu.utils import json as kombu_json
from kombu.utils.encoding import bytes_to_str

from asyncinfer.backoff import Backoff
from asyncinfer.broker.atomic_take import AtomicTake
from asyncinfer.broker.celery_claims import CeleryClaims, claims_on
from asyncinfer.broker.refusals import REFUSED_CLASSES, refusal_reason, refusing_parser
from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.envelope import (
    MALFORMED_DROPPED,
    Message,
    malformed_error,
    parse_envelope,
    printable,
)
from asyncinfer.wire.keys import LEASE_HOLDERS_KEY, LEASES_KEY

__all__ = ["Transport", "SecureTransport", "Channel", "SentinelTransport", "SentinelChannel",
           "OnMalformed", "REFUSING_PARSER", "answering"]

log = logging.getLogger(__name__)

#: Stores the FAILURE of a malformed message's request: (request ID, error, the message's headers,
#: its queue).
OnMalformed = Callable[[str, InvalidRequest, dict[str, Any], str], None]

_Empty = virtual.Empty


@functools.cache
def answering(client_cls: type) -> type:
    """``client_cls`` whose ``ping`` counts a refusal (``MISCONF`` refuses even PING) as an answer."""

    class Client(client_cls):  # type: ignore[misc, valid-type]
        def ping(self, **kwargs: Any) -> Any:
            try:
                return super().ping(**kwargs)
            except REFUSED_CLASSES:
                return True

    Client.__name__ = Client.__qualname__ = f"Answering{client_cls.__name__}"
    return Client


class QoS(kombu_redis.QoS):
    """kombu's acknowledgement emulation; an acknowledgement Redis refuses is made again later
    (the message stays unacknowledged meanwhile, never lost)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Tags the atomic take recorded already (broker/atomic_take.py): not written again.
        self.recorded: set[str] = set()

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag in self.recorded:
            virtual.QoS.append(self, message, delivery_tag)
        else:
            super().append(message, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        try:
            super().ack(delivery_tag)
        except REFUSED_CLASSES as exc:
            # done here (its prefetch slot freed: the channel consumes again, and acknowledges
            # again before it does); still unacknowledged in Redis until then
            virtual.QoS.ack(self, delivery_tag)
            self.channel._acks_due.append(delivery_tag)
            self.channel._refused("an acknowledgement", exc)
        self._freed()

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        super().reject(delivery_tag, requeue)
        self._freed()

    def _freed(self) -> None:
        """A slot of the prefetch window is free (acknowledged or rejected, from any thread: the
        pipeline's writer acknowledges). A channel with no take in flight stopped taking because
        its window was full, and kombu's event loop, asleep in its poll, would see the room only
        when something else woke it (with a window of 128: a batch every 50 ms instead of 10,
        and a high-priority message 700 ms in Redis); it is woken now, and takes what the room
        allows in its next turn, best level first."""
        ch = self.channel
        if ch._in_poll:
            return
        loop = getattr(ch.connection, "event_loop", None)
        if loop is not None:
            loop.call_soon(_take_again)  # thread-safe: one wakeup, however many acks

    def restore_visible(self, *args: Any, **kwargs: Any) -> Any:
        """kombu's restore sweep; skipped this time when Redis refuses it (its lock is a write)."""
        try:
            return super().restore_visible(*args, **kwargs)
        except REFUSED_CLASSES as exc:
            log.warning("Redis refused the restore sweep: %s; it runs again on its next turn",
                        refusal_reason(exc) or printable(exc))
            return None

    def _remove_from_indices(self, delivery_tag: str, pipe: Any = None) -> Any:
        """kombu's, and the message's lease with it when the channel leases (broker/atomic_take.py)."""
        pipe = super()._remove_from_indices(delivery_tag, pipe)
        if self.channel.lease_s:
            pipe = pipe.zrem(LEASES_KEY, delivery_tag).hdel(LEASE_HOLDERS_KEY, delivery_tag)
        return pipe

    def ack_due(self) -> None:
        """Make the acknowledgements Redis refused before, until it refuses again."""
        due = self.channel._acks_due
        while due:
            self._remove_from_indices(due[0]).execute()  # a refusal leaves it due
            due.popleft()


class Channel(AtomicTake, kombu_redis.Channel):
    """kombu's Redis channel that checks what it pops, rides out Redis' refusals, and (with the
    transport option ``atomic_take``) takes with the fast consumer's atomic script."""

    QoS = QoS
    from_transport_options = (kombu_redis.Channel.from_transport_options  # type: ignore[assignment]
                              + AtomicTake.OPTIONS + ("claim_ttl_s",))
    #: How long a producer's ``asyncinfer.infer`` claims its task ID (the result expiry; 0: a
    #: day); broker/celery_claims.py.
    claim_ttl_s = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._backoff = Backoff()
        #: Popped messages whose bookkeeping Redis refused: (queue, envelope), oldest first.
        self._unrecorded: deque[tuple[str, dict[str, Any]]] = deque()
        #: Acknowledgements Redis refused, made again before the next BRPOP.
        self._acks_due: deque[str] = deque()
        self._claims: CeleryClaims | None = None
        super().__init__(*args, **kwargs)

    def close(self) -> None:
        self._stop_leases()
        super().close()

    # -- connections -----------------------------------------------------------------------------

    def _get_pool(self, asynchronous: bool = False) -> Any:
        pool = super()._get_pool(asynchronous)
        # its connections read replies with the refusing parser (a plain ResponseError for
        # MISCONF, BUSY, ... becomes a RedisRefusal, a connection error here)
        kwargs = getattr(pool, "connection_kwargs", None)
        if isinstance(kwargs, dict):
            kwargs.setdefault("parser_class", REFUSING_PARSER)
        return pool

    def _get_client(self) -> Any:
        client = super()._get_client()
        if isinstance(client, functools.partial):  # a global key prefix
            return functools.partial(answering(client.func), *client.args, **client.keywords)
        return answering(client)

    # -- publishing ------------------------------------------------------------------------------

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        """kombu's publish; a first send of an ``asyncinfer.infer`` request claims its task ID
        in the same round trip (broker/celery_claims.py): the same ID sent again as the same
        request is not pushed again, as another request raises RequestIdReused."""
        if kwargs.get("_publish_batch") is not None or not claims_on(self, queue, message):
            return super()._put(queue, message, **kwargs)
        if self._claims is None:
            self._claims = CeleryClaims(self.client, float(self.claim_ttl_s or 86400))
        priority = self._get_message_priority(message, reverse=False)
        with self.conn_or_acquire() as client:
            if not self._claims.put(client, queue, message, kombu_json.dumps(message), priority):
                client.lpush(self._q_for_pri(queue, priority), kombu_json.dumps(message))
        return None

    # -- consuming -------------------------------------------------------------------------------

    def _brpop_start(self, timeout: int | None = None) -> None:
        if self._backoff.waiting:
            return  # the poller asks again on its next tick
        try:
            self.qos.ack_due()
        except REFUSED_CLASSES as exc:
            self._refused("an acknowledgement", exc)
            return
        try:
            while self._unrecorded:
                queue, envelope = self._unrecorded[0]
                self._deliver(envelope, queue, unrecorded=True)
        except REFUSED_CLASSES as exc:
            self._refused("the bookkeeping of a taken message", exc)
            return
        if self._takes_atomically():
            self._take_start()
        else:
            super()._brpop_start(timeout)

    def _brpop_read(self, **options: Any) -> bool:
        """kombu's, with the popped message checked before kombu loads it and a refusal of the
        BRPOP itself ridden out."""
        taken = dest__item = None
        try:
            try:
                if self._take_sent:  # the atomic take's (broker/atomic_take.py)
                    taken = self._take_reply(**options)
                else:
                    dest__item = self.client.parse_response(self.client.connection, "BRPOP",
                                                            **options)
            except REFUSED_CLASSES as exc:  # the reply was read whole: the connection is fine
                self._refused("consuming", exc)
                raise _Empty() from None
            except self.connection_errors:
                # if there's a ConnectionError, disconnect so the next
                # iteration will reconnect automatically.
                self.client.connection.disconnect()
                raise
            self._backoff.reset()
            if taken:
                for queue, raw, recorded, died in taken:
                    self._took(queue, raw, recorded, died)
                return True
            if not dest__item:
                raise _Empty()
            dest, item = dest__item
            dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            envelope = self._checked(item, dest)
            if envelope is not None:
                self._deliver(envelope, dest, raw=item)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]
            self._flush_brpop_reauth()

    def _get(self, queue: str, timeout: Any = None) -> dict[str, Any]:
        """kombu's: the next message of ``queue`` (by priority), checked; a malformed one is
        answered and the next one taken."""
        with self.conn_or_acquire() as client:
            for pri in self.priority_steps:
                while True:
                    item = client.rpop(self._q_for_pri(queue, pri))
                    if not item:
                        break
                    envelope = self._checked(item, queue)
                    if envelope is not None:
                        self._maybe_update_queues_expire(client, queue)
                        return envelope
            self._maybe_update_queues_expire(client, queue)
            raise _Empty()

    def decode_body(self, body: Any, encoding: str | None = None) -> Any:
        try:
            return super().decode_body(body, encoding)
        except Exception as exc:  # noqa: BLE001 - kombu would end the worker: answered as malformed
            raise _BadBody(f"the message body is not valid {encoding} (its body_encoding): "
                           f"{type(exc).__name__}: {printable(exc)}") from None

    def _checked(self, raw: Any, queue: str) -> dict[str, Any] | None:
        """The envelope of ``raw`` if it keeps the rules of a kombu message, else None (answered)."""
        delivery = Message(raw=raw, queue=queue)
        try:
            parse_envelope(delivery, loads=_kombu_loads)  # kombu's reader, as kombu loads it
        except Exception as exc:  # noqa: BLE001 - RecursionError, MemoryError, ...: this one only
            self._malformed(delivery, exc)
            return None
        return delivery.envelope

    def _deliver(self, envelope: dict[str, Any], queue: str, raw: Any = None,
                 unrecorded: bool = False) -> bool:
        """Hand ``envelope`` to kombu (which records it as unacknowledged, then calls the
        consumer); True when kombu took it. One kombu cannot even make a message of is answered
        as malformed; one whose bookkeeping Redis refuses is held to be recorded again
        (``unrecorded``: it is the first held one; a refusal is raised, and it stays held)."""
        tag = envelope["properties"]["delivery_tag"]
        try:
            self.connection._deliver(envelope, queue)
        except REFUSED_CLASSES as exc:
            if tag in self.qos._delivered:  # recorded: a refusal the consumer met after
                if unrecorded:
                    self._unrecorded.popleft()
                raise
            if unrecorded:
                raise
            self._unrecorded.append((queue, envelope))
            self._refused("the bookkeeping of a taken message", exc)
            return False
        except Exception as exc:
            if tag in self.qos._delivered:  # the consumer's own error, after kombu took it
                if unrecorded:
                    self._unrecorded.popleft()
                raise
            delivery = Message(raw=raw if raw is not None else repr(envelope)[:4096].encode(),
                               queue=queue, envelope=envelope)
            request_id = delivery.headers.get("id")
            delivery.request_id = request_id if isinstance(request_id, str) else ""
            self._malformed(delivery, InvalidRequest(f"request {delivery.request_id}: {exc}")
                            if isinstance(exc, _BadBody) and delivery.request_id else exc)
            if unrecorded:
                self._unrecorded.popleft()
            return False
        if unrecorded:
            self._unrecorded.popleft()
        return True

    def _malformed(self, delivery: Message, exc: BaseException) -> None:
        error = malformed_error(delivery, exc)
        if error is None:
            log.error(MALFORMED_DROPPED, delivery.queue, type(exc).__name__, printable(exc),
                      printable(delivery.raw))
            return
        on_malformed: OnMalformed | None = getattr(self.connection, "on_malformed", None)
        if on_malformed is None:  # no consumer to store its FAILURE
            log.error("%s", printable(error, 1000))
            return
        try:
            on_malformed(delivery.request_id, error, delivery.headers, delivery.queue)
        except Exception:  # noqa: BLE001 - the message is dropped either way; say so
            log.exception("request %s: could not store its FAILURE",
                          printable(delivery.request_id))

    def _refused(self, what: str, exc: BaseException) -> None:
        wait_s = self._backoff.failed()
        log.warning("Redis refused %s: %s; again in %.1f s", what,
                    refusal_reason(exc) or printable(exc), wait_s)


def _take_again() -> None:
    """Nothing: run by the woken event loop, whose next tick starts the channel's take."""


def _kombu_loads(raw: Any) -> Any:
    """kombu's reading of a message (its JSON hooks), except that text which is not UTF-8 is
    malformed, as the fast consumer holds (kombu would replace the bytes it cannot read)."""
    return kombu_json.loads(raw.decode() if isinstance(raw, (bytes, bytearray)) else raw)


class _BadBody(ValueError):
    """A message body that does not decode by its ``body_encoding``."""


#: The parser of every connection of the transports: Redis' refusals are connection errors.
REFUSING_PARSER = refusing_parser()


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel`; Redis' refusals are connection errors."""

    Channel = Channel
    connection_errors = kombu_redis.Transport.connection_errors + REFUSED_CLASSES
    #: Set by the consumer: stores the FAILURE of a malformed message's request.
    on_malformed: OnMalformed | None = None
    #: The event loop (Celery's hub) the transport consumes in; None when it drains without one.
    event_loop: Any = None

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self.event_loop = loop
        super().register_with_event_loop(connection, loop)


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """:class:`Channel` on the master a Sentinel group names."""

    from_transport_options = (kombu_redis.SentinelChannel.from_transport_options  # type: ignore[assignment]
                              + AtomicTake.OPTIONS)


class SentinelTransport(Transport):
    """kombu's Sentinel transport with :class:`SentinelChannel`."""

    Channel = SentinelChannel
    default_port = kombu_redis.SentinelTransport.default_port  # type: ignore[assignment]


class SecureTransport(Transport):
    """:class:`Transport` for ``rediss://`` URLs (named so in a connection's URL)."""

