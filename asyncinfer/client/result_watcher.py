"""One thread per client that learns of finished requests through Redis pub/sub.

Celery's Redis backend stores a result with SET and publishes the same payload on a channel named
after the key. A request this client sent names the client's own reply channel as well
(wire/reply.py), and workers publish its final result there too: the watcher subscribes to that one
channel when it connects, so a request it sent costs no subscription and no look-up at all. A
request it did not send (``Client.future(id)``, a duplicate of another producer's request) is
watched on its own channel: subscribe, then read the key once (a result stored before the
subscription is not missed), and wake when either arrives.

Nothing is missed across a lost connection: after each (re)connect the watcher subscribes, waits
for Redis to confirm, and only then reads every watched key. A request watched after that read
is covered by the live subscription.

The backstop, for a result stored by something that does not announce it (a worker of an older
release during a rolling upgrade, a tool writing results itself), and for a result stored between
the read of a key and its subscription (commands of two connections reach Redis in either order;
on a cluster a PUBLISH reaches the other nodes later): every watched request is also looked up
``sweep_first_s`` after it was watched, then at doubling intervals up to ``sweep_max_s``. When a
look-up finds a result that its announcement on the reply channel should have brought (stored more
than ``late_s`` earlier), the watcher logs it and watches new requests on their own channels for
``fallback_for_s``. It blocks in ``select`` on the pub/sub socket and a wake-up pipe.

A request the broker lost (no result, and its trace gone: lost_check.py) is ended with
:class:`~asyncinfer.errors.RequestLost` by the same thread, from its :class:`LostCheck`'s looks.
"""

from __future__ import annotations

import heapq
import logging
import os
import select
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import redis
from celery import states

from asyncinfer.backoff import Backoff
from asyncinfer.client.lost_check import LostCheck, lost_error
from asyncinfer.client.pubsub_reader import buffered_message
from asyncinfer.client.responses import decode_stored
from asyncinfer.errors import AsyncInferError
from asyncinfer.wire.keys import REPLY_CHANNEL_PREFIX
from asyncinfer.wire.reply import announced_payloads

__all__ = ["ResultWatcher", "result_key_prefix"]

log = logging.getLogger(__name__)

#: How a JSON-stored STARTED state begins (Celery's meta: ``{"status": "STARTED", ...``).
_STARTED = b'"STARTED"'


#: Called with the decoded result meta (``status``, ``result``, ...) once the request is done.
Callback = Callable[[dict[str, Any]], None]


class ResultWatcher:
    """Delivers each watched request's final result meta to its callback, once."""

    #: How long the rest of a message that has begun to arrive may take (seconds).
    read_timeout_s = 30.0
    #: A watched request is looked up this long after it was watched …
    sweep_first_s = 2.0
    #: … then at doubling intervals up to this (seconds).
    sweep_max_s = 30.0
    #: Keys read in one look-up at most.
    sweep_chunk = 100
    #: A looked-up result stored this long ago (seconds) should have been announced …
    late_s = 1.0
    #: … and when one was not, new requests are watched on their own channels this long (seconds).
    fallback_for_s = 60.0

    def __init__(self, backend: Any, lost_check: LostCheck | None = None) -> None:
        self.backend = backend
        #: Ends the futures of requests the broker lost (None: not checked).
        self.lost_check = lost_check
        self._client: redis.Redis = backend.client
        self._key_prefix = result_key_prefix(backend)
        #: This client's reply channel: requests it sends name it (wire/reply.py).
        self.channel = REPLY_CHANNEL_PREFIX + uuid.uuid4().hex
        self._callbacks: dict[str, list[Callback]] = {}
        #: Requests watched on their own channel (subscribed, or in ``_new`` to subscribe).
        self._keyed: set[str] = set()
        self._new: list[str] = []
        #: Look-ups of requests watched through the reply channel: (due, interval, request ID).
        self._sweeps: list[tuple[float, float, str]] = []
        self._fallback_until = 0.0
        self._pubsub: Any = None
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = False
        #: Whether the watcher thread has been connected to Redis once.
        self._connected = False
        self._thread = threading.Thread(target=self._run, name="asyncinfer-results", daemon=True)
        self._thread.start()

    def key(self, request_id: str) -> str:
        """The result key (and pub/sub channel) of a request: the backend's key prefix and the ID
        (what ``backend.get_key_for_task`` spells, without its per-call conversions)."""
        if not request_id:
            raise ValueError(f"task_id must not be empty. Got {request_id!r} instead.")
        return self._key_prefix + request_id

    def watch(self, request_id: str, callback: Callback, *, announced: bool = False) -> None:
        """Call ``callback(meta)`` once ``request_id`` is ready (at once if it already is).

        ``announced``: the request names this watcher's :attr:`channel` as its reply channel (it
        is about to be sent, or was sent, by this client), so no subscription of its own is needed.
        Several callbacks may wait on one request (the same ID submitted twice, say)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("result watcher is closed")
            self._callbacks.setdefault(request_id, []).append(callback)
            now = time.monotonic()
            heapq.heappush(self._sweeps, (now + self.sweep_first_s, self.sweep_first_s,
                                          request_id))
            if announced and now >= self._fallback_until:
                return  # the reply channel's subscription covers it: nothing to wake for
            self._keyed.add(request_id)
            self._new.append(request_id)
        os.write(self._wake_w, b"x")

    def watch_own_channel(self, request_id: str) -> None:
        """Watch ``request_id`` on its own channel too (it was sent by another producer, whose
        reply channel is not this one: a duplicate of an ID already sent)."""
        with self._lock:
            if request_id not in self._callbacks or request_id in self._keyed:
                return
            self._keyed.add(request_id)
            self._new.append(request_id)
        os.write(self._wake_w, b"x")

    def unwatch(self, request_id: str, callback: Callback | None = None) -> None:
        """Stop calling ``callback`` for ``request_id`` (None: every callback of it); the request
        is no longer watched once no callback waits on it. Another waiter of the same ID (the
        same request submitted twice, or a refused submit of an ID an accepted one holds) keeps
        waiting."""
        with self._lock:
            waiting = self._callbacks.get(request_id)
            if waiting is not None and callback is not None:
                if callback in waiting:
                    waiting.remove(callback)
                if waiting:
                    return
            self._callbacks.pop(request_id, None)
            self._keyed.discard(request_id)
        if self.lost_check is not None:
            self.lost_check.forget(request_id)

    def _id_of(self, channel: Any) -> str | None:
        """The request whose result key ``channel`` is (None: another channel)."""
        name = _text(channel)
        return name[len(self._key_prefix):] if name.startswith(self._key_prefix) else None

    def trace(self, request_id: str, *, seen: bool) -> None:
        """Judge whether the broker lost the watched ``request_id`` (lost_check.py); ``seen``: this
        client's publish wrote its trace. Nothing without a lost check."""
        if self.lost_check is None:
            return
        with self._lock:
            if request_id not in self._callbacks:
                return  # answered already
            self.lost_check.trace(request_id, seen=seen)

    def close(self) -> None:
        """Stop the thread and close the pub/sub connection."""
        with self._lock:
            self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- watcher thread ------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = Backoff()
        failed = 0  # in a row, before the watcher ever connected
        while not self._closed:
            pubsub = self._client.pubsub()
            try:
                self._serve(pubsub)
                backoff.reset()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                if self._closed:
                    break
                if isinstance(exc, redis.TimeoutError) and self._answers():
                    # A read that timed out on a server that answers: the connection was slow
                    # (a loaded client or server), not lost. Nothing to warn about; a new
                    # connection resubscribes and reads every watched key again.
                    log.debug("result watcher: a pub/sub read timed out (%s); resubscribing", exc)
                else:
                    wait_s = backoff.failed()
                    failed = 0 if self._connected else failed + 1
                    # Not yet connected: the submit that needs Redis says so itself (a
                    # command that fails at once prints its one line alone); a watcher that
                    # cannot connect for a while warns.
                    level = logging.WARNING if self._connected or failed > 3 else logging.DEBUG
                    log.log(level, "result watcher lost Redis (%s); reconnecting in %.1f s", exc,
                            wait_s)
                    time.sleep(wait_s)
            finally:
                try:
                    pubsub.close()
                except Exception:  # noqa: BLE001
                    pass

    def _answers(self) -> bool:
        """Whether Redis answers a PING now (so a timeout was not a lost connection)."""
        try:
            return bool(self._client.ping())
        except (redis.RedisError, OSError):
            return False

    def _serve(self, pubsub: Any) -> None:
        self._pubsub = pubsub  # the connection now in use (tests cut it)
        self._connect(pubsub)
        self._connected = True
        while not self._closed:
            finished = self._subscribe_new(pubsub)
            # Read while anything is buffered or readable (subscribe replies are messages too),
            # so the select below never sleeps on data already read. Once a message has begun to
            # arrive, the rest of it may take a while (a large result): read it with a real
            # timeout, not the zero one that only asks whether something is there.
            while True:
                channel, payload = buffered_message(pubsub)
                if channel is None:  # nothing parsed and waiting: redis-py's own reading
                    if not pubsub.connection.can_read(timeout=0):
                        break
                    message = pubsub.get_message(timeout=self.read_timeout_s)
                    if message is None:
                        break
                    if message.get("type") != "message":
                        continue
                    channel, payload = message["channel"], message["data"]
                if _text(channel) == self.channel and isinstance(payload, bytes):
                    for one in announced_payloads(payload):  # a batch's results, grouped
                        self._deliver_payload(one)
                elif (self._deliver_payload(payload, self._id_of(channel))
                      and _text(channel) != self.channel):
                    finished.append(channel)
            if finished:
                pubsub.unsubscribe(*finished)
            wait_s = min(self._sweep(), self._look_for_lost())
            sock = pubsub.connection._sock
            readable, _, _ = select.select([sock, self._wake_r], [], [], wait_s)
            if self._wake_r in readable:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass

    def _connect(self, pubsub: Any) -> None:
        """Subscribe to the reply channel and wait for Redis to confirm; then every watched
        request is read again (and those watched on their own channels resubscribed), so nothing
        finished while the watcher was not subscribed is missed."""
        pubsub.subscribe(self.channel)
        deadline = time.monotonic() + self.read_timeout_s
        while True:
            message = pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))
            if message is not None and message.get("type") == "subscribe":
                break
            if message is None and time.monotonic() >= deadline:
                raise redis.TimeoutError("no confirmation of the reply channel's subscription")
        with self._lock:
            watched = list(self._callbacks)
            self._new = [i for i in watched if i in self._keyed]
        self._look_up(watched)

    def _subscribe_new(self, pubsub: Any) -> list[Any]:
        """Subscribe to the channels of requests newly watched on their own; return the keys
        already finished."""
        with self._lock:
            ids, self._new = self._new, []
        if not ids:
            return []
        keys = [self.key(i) for i in ids]
        pubsub.subscribe(*keys)
        return [key for key, request_id, payload in zip(keys, ids, self._client.mget(keys),
                                                        strict=True)
                if payload is not None and self._deliver_payload(payload, request_id)]

    def _look_up(self, request_ids: list[str], *, late_after_s: float | None = None) -> list[str]:
        """Read the keys of ``request_ids`` and deliver the finished; return those not finished.
        With ``late_after_s``, a finished one stored longer ago than that was not announced."""
        pending = []
        for start in range(0, len(request_ids), self.sweep_chunk):
            ids = request_ids[start:start + self.sweep_chunk]
            payloads = self._client.mget([self.key(i) for i in ids])
            for request_id, payload in zip(ids, payloads, strict=True):
                meta = self._deliver_payload(payload, request_id) if payload is not None else None
                if meta is None:
                    pending.append(request_id)
                elif late_after_s is not None and _age_s(meta) > late_after_s:
                    self._fall_back(request_id)
        return pending

    def _sweep(self) -> float:
        """Look up the requests whose look-up is due; seconds until the next one is (at most 1)."""
        now = time.monotonic()
        due: dict[str, float] = {}
        with self._lock:
            while self._sweeps and self._sweeps[0][0] <= now:
                _, interval_s, request_id = heapq.heappop(self._sweeps)
                if request_id in self._callbacks:
                    due[request_id] = interval_s
        if due:
            with self._lock:
                keyed = [i for i in due if i in self._keyed]
            announced = [i for i in due if i not in keyed]
            # a request watched on its own channel: not announced, so never late; looked up all
            # the same (its key is read as its subscription is sent, and Redis orders the two
            # connections' commands as it pleases: on a cluster, a node's PUBLISH reaches the
            # others later still)
            pending = (self._look_up(announced, late_after_s=self.late_s)
                       + self._look_up(keyed))
            with self._lock:
                for request_id in pending:
                    if request_id in self._callbacks:
                        interval_s = min(due[request_id] * 2, self.sweep_max_s)
                        heapq.heappush(self._sweeps, (now + interval_s, interval_s, request_id))
        with self._lock:
            next_s = self._sweeps[0][0] - time.monotonic() if self._sweeps else 1.0
        return min(1.0, max(0.0, next_s))

    def _look_for_lost(self) -> float:
        """End the futures of requests the broker lost (when a look is due); seconds until the
        next look (at most 1)."""
        check = self.lost_check
        if check is None:
            return 1.0
        for request_id in check.look():
            with self._lock:
                callbacks = self._callbacks.pop(request_id, None) or []
                self._keyed.discard(request_id)
            if callbacks:
                log.warning("request %s: lost by the broker (no result, no trace); its future "
                            "ends with RequestLost", request_id)
            meta = {"status": states.FAILURE, "task_id": request_id,
                    "result": lost_error(request_id)}
            for callback in callbacks:
                try:
                    callback(meta)
                except Exception:  # noqa: BLE001 - a callback's error must not stop the watcher
                    log.exception("callback for request %s raised", request_id)
        return min(1.0, check.due_in_s())

    def _fall_back(self, request_id: str) -> None:
        if time.monotonic() >= self._fallback_until:
            log.warning("request %s: its result was stored but not announced on this client's "
                        "reply channel (a worker of an older release?); watching new requests on "
                        "their own channels for %.0f s", request_id, self.fallback_for_s)
        self._fallback_until = time.monotonic() + self.fallback_for_s

    def _deliver_payload(self, payload: Any, key_id: str | None = None) -> dict[str, Any] | None:
        """Hand a stored result to its callbacks; its meta when the request is finished.

        ``key_id``: the request whose key (or channel) held it, when known. What someone else
        stored never stops the watcher: a failure naming no exception type settles its future
        with an error saying so (client/stored_errors.py); a payload that is no result at all
        settles the future of ``key_id`` likewise, and is otherwise logged and skipped."""
        if isinstance(payload, bytes) and _STARTED in payload[:32]:
            return None  # the STARTED state (task_track_started): not worth decoding
        try:
            meta = decode_stored(self.backend, payload)
        except Exception as exc:  # noqa: BLE001 - another producer's or a tool's writing
            if key_id is None:
                log.warning("result watcher: a payload that is no stored result was skipped "
                            "(%s: %s)", type(exc).__name__, exc)
                return None
            meta = {"status": states.FAILURE, "task_id": key_id, "result": AsyncInferError(
                f"request {key_id}: its stored result cannot be read "
                f"({type(exc).__name__}: {exc})")}
        if meta.get("status") not in states.READY_STATES:
            return None
        request_id = meta.get("task_id")
        if not isinstance(request_id, str):
            if key_id is None:
                return meta  # stored without its ID, by hand: whose it is, nobody can say
            request_id = meta["task_id"] = key_id
        with self._lock:
            callbacks = self._callbacks.pop(request_id, None) or []
            self._keyed.discard(request_id)
        if self.lost_check is not None:
            self.lost_check.forget(request_id)
        for callback in callbacks:
            try:
                callback(meta)
            except Exception:  # noqa: BLE001 - a callback's error must not stop the watcher
                log.exception("callback for request %s raised", request_id)
        return meta


def result_key_prefix(backend: Any) -> str:
    """What a request's result key is before its ID (Celery's ``celery-task-meta-``, after any
    ``result_backend_transport_options`` ``global_keyprefix``)."""
    prefix = backend.task_keyprefix
    return prefix.decode() if isinstance(prefix, bytes) else str(prefix)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _age_s(meta: dict[str, Any]) -> float:
    """Seconds since a result meta's ``date_done`` (0 when it has none)."""
    done = meta.get("date_done")
    if not isinstance(done, str):
        return 0.0
    try:
        at = datetime.fromisoformat(done)
    except ValueError:
        return 0.0
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - at).total_seconds()
