"""The core of every submit, blocking or asyncio: a request from its :class:`Outgoing` to its watched
future.

:class:`Sender` holds what sending needs — the Celery app, the broker's client and its publisher,
the result watcher, the queue bounds, the unknown-model check — and nothing of the callers above
it: :class:`~asyncinfer.client.client.Client` (the blocking API) and the asyncio forms
(client/aio.py, which publish from the event loop through :meth:`Sender.watched`,
:meth:`Sender.publish_options` and :meth:`Sender.sent`) both stand on it.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from asyncinfer.broker.clock_skew import CLOCK_FOLLOWER
from asyncinfer.broker.connections import broker_error, never_resend, redis_client
from asyncinfer.broker.kombu_connection import publish_blocked
from asyncinfer.broker.publisher import DUPLICATE, Publisher
from asyncinfer.broker.shards import request_shard
from asyncinfer.broker.urls import is_redis_url
from asyncinfer.client.backend_claims import claim_on_backend, release_claim
from asyncinfer.client.grouped import GroupedPublisher
from asyncinfer.client.input_check import refuse_unfit
from asyncinfer.client.known_models import KnownModels
from asyncinfer.client.loop_publisher import LoopPublishers
from asyncinfer.client.lost_check import LostCheck, trace_ttl_s
from asyncinfer.client.outgoing import Outgoing
from asyncinfer.client.responses import InferFuture
from asyncinfer.client.result_watcher import ResultWatcher
from asyncinfer.client.submit_span import end_with_error, end_with_future, start_submit_span
from asyncinfer.client.tensor_refs import by_reference
from asyncinfer.config.model_options import ModelOptions
from asyncinfer.config.settings import DEFAULT_BROKER_URL, Settings
from asyncinfer.constants import TASK_NAME
from asyncinfer.errors import (
    AsyncInferError,
    BrokerRefused,
    BrokerUnavailable,
    InvalidRequest,
)
from asyncinfer.store.tensor_store import TensorStore, store_from_settings
from asyncinfer.tracing import tracing_for
from asyncinfer.wire.cache_key import cache_key
from asyncinfer.wire.messages import uuid4_text
from asyncinfer.wire.tensor_refs import REFS_ACCEPTED

__all__ = ["Sender"]

log = logging.getLogger(__name__)

#: A sender's tensor store before it is first asked for (opening one imports fsspec).
_UNOPENED = object()


class Sender:
    """Sends requests of the app ``app`` (built from ``settings``) and watches their results.

    ``known``: the unknown-model check (None: every model passes). ``lanes``: on a cluster URL
    that spreads requests over N shards, the senders of shards 1 to N - 1 (this one sends on
    shard 0): a request goes out on, and is watched from, the shard its ID falls in (a
    sequence's request: its sequence's), where the workers store its result.
    """

    def __init__(self, settings: Settings, app: Celery, known: KnownModels | None = None,
                 lanes: Sequence[Sender] = ()) -> None:
        self.settings = settings
        #: The sender of each shard (index: the shard); [self] but on a spread cluster URL.
        self.lanes: list[Sender] = [self, *lanes]
        self.app = app
        self.known = known
        self._store: object = _UNOPENED
        #: OpenTelemetry, when ``ASYNCINFER_TRACING`` asks for it (None: off, nothing imported).
        self.tracing = tracing_for(settings)
        # The ResultWatcher subscribes to each request's result; Celery's own result consumer
        # would subscribe a second time on every send. AsyncResult.get() still subscribes itself.
        self.app.backend.on_task_call = _skip_on_task_call
        self._watcher: ResultWatcher | None = None
        # Two threads' first requests must not start two watchers (one would own the futures,
        # the other the lost check's traces).
        self._watcher_lock = threading.Lock()
        # On a Redis broker a request is one LPUSH of Celery's message (what send_task would
        # publish), without Celery's per-send machinery; other brokers use send_task.
        broker_url = str(self.app.conf.broker_url)
        #: The Redis client of the broker (None on another broker).
        self.broker: redis.Redis | None = (
            redis_client(broker_url, self.settings, socket_connect_timeout=self.settings.connect_timeout_s,
                         retry=never_resend())  # a group lost on its way back is not sent again
            if is_redis_url(broker_url) else None)
        if self.broker is not None:  # every expires is set on the broker's clock (wire/clock.py)
            CLOCK_FOLLOWER.follow(self.broker)
        trace_s = trace_ttl_s(self.settings.lost_after_s, self.settings.result_expires_s)
        self._publisher = (Publisher(self.broker, claim_ttl_s=self.settings.result_expires_s,
                                     replicas=self.settings.submit_replicas,
                                     replicas_timeout_s=self.settings.submit_replicas_timeout_s,
                                     mark_ttl_s=trace_s)
                           if self.broker is not None else None)
        #: Sends the requests of every thread, those that arrived while the last round trip
        #: was out in the next (grouped.py): a producer far from Redis does not wait one per request.
        self.grouped = (GroupedPublisher(self._publisher, self._publish_error)
                        if self._publisher is not None else None)
        self._results_shared = str(self.app.conf.result_backend) == broker_url
        self._options: dict[str | None, ModelOptions] = {}
        #: Nothing configured and no ``asyncinfer up`` running: the default URL is a guess.
        self._broker_guessed = self.settings.broker_url_origin() == "default"
        #: Where coroutines publish small requests themselves (aio.send_on_loop).
        self.loop_publishers = LoopPublishers(
            broker_url if self.broker is not None else "", self._publish_error,
            claim_ttl_s=self.settings.result_expires_s, replicas=self.settings.submit_replicas,
            connect_timeout_s=self.settings.connect_timeout_s,
            mark_ttl_s=trace_s if self.broker is not None else 0.0)

    @property
    def watcher(self) -> ResultWatcher:
        """The result watcher (started on first use)."""
        watcher = self._watcher
        if watcher is not None:
            return watcher
        with self._watcher_lock:
            if self._watcher is None:
                self._watcher = ResultWatcher(self.app.backend, LostCheck.of(
                    self.broker, self.app.backend, lost_after_s=self.settings.lost_after_s,
                    result_expires_s=self.settings.result_expires_s))
            return self._watcher

    def knows_now(self, model: str) -> bool:
        """Whether :meth:`check_model` can judge ``model`` without reading the catalogue."""
        return self.known is None or self.known.fresh(model)

    def check_model(self, model: str, request_id: str = "") -> None:
        """Raise :class:`~asyncinfer.errors.UnknownModel` when the fleet has announced models, but
        not ``model``, within ``model_retention_s`` (0: never)."""
        if self.known is not None:
            self.known.check(model, request_id)

    def submission(self, model: str, inputs: Any, *, request_id: str | None = None,
                   parameters: Mapping[str, Any] | None = None, serializer: str | None = None,
                   binary: bool | None = None, check: bool = True, **options: Any) -> Outgoing:
        """The ``asyncinfer.infer`` request of ``model`` for ``inputs``, checked and not yet sent
        (``check``: the unknown-model check and the inputs' against the model's declared ones
        too); :meth:`Client.submit <asyncinfer.client.client.Client.submit>` has the options."""
        serializer = serializer or self.settings.task_serializer
        if serializer not in ("json", "msgpack"):
            raise ValueError(f"serializer must be 'json' or 'msgpack', got {serializer!r}")
        if binary is None:
            binary = serializer == "msgpack"
        claim = request_id is not None  # generated IDs cannot collide
        request_id = uuid4_text() if request_id is None else request_id
        if check:
            self.check_model(model, request_id)
        priority = options.get("priority") or 0
        if options.get("expires") is None and type(priority) is int:  # checked by Outgoing
            # the level's default timeout (Triton's, with timeout_action REJECT)
            timeout_s = self._model_options(model).level_policy(
                priority).default_timeout_s
            if timeout_s > 0:
                options["expires"] = timeout_s
        # a body limit the client holds requests to on Redis only (Outgoing.message): a request
        # whose inputs show it is over is refused there before they are encoded
        limit = self.settings.max_payload_bytes if self.broker is not None else None
        if self.settings.tensor_store_url and self.store is not None:  # large tensors by reference
            inputs = by_reference(inputs, request_id, self.store, self.settings.tensor_ref_bytes,
                                  binary)
            parameters = {**(parameters or {}), REFS_ACCEPTED: True}
        outgoing = Outgoing.infer(model, inputs, request_id, claim, serializer, binary=binary,
                                  parameters=parameters, max_body_bytes=limit, **options)
        if check and self.known is not None:  # its inputs against its model's (input_check.py)
            refuse_unfit(self.known.signature(model), outgoing.request_id, outgoing.kwargs)
        return outgoing

    def submit(self, model: str, inputs: Any, **options: Any) -> InferFuture:
        """Send one ``asyncinfer.infer`` request (:meth:`submission`'s options); its future."""
        return self.send_watched(self.submission(model, inputs, **options))

    def lane(self, request_id: str) -> Sender:
        """The sender of request ``request_id``'s shard (this one but on a spread cluster URL)."""
        lanes = self.lanes
        return lanes[request_shard(request_id, len(lanes))] if len(lanes) > 1 else self

    def lane_of(self, outgoing: Outgoing) -> Sender:
        """The sender of ``outgoing``'s shard: its sequence's (all of a sequence's requests go to
        one shard, where its worker is registered), else its ID's."""
        if len(self.lanes) == 1:
            return self
        sequence = outgoing.sequence
        return self.lane(sequence.key if sequence is not None else outgoing.request_id)

    def send_watched(self, outgoing: Outgoing) -> InferFuture:
        """Watch ``outgoing``'s request, then send it; its future.

        On a Redis broker the request goes out in the next group (:attr:`grouped`): this returns
        before it is on its queue, and a refusal (the queue full past its timeout, the broker
        unreachable, ...) ends the future with that error; ``future.sent()`` waits for the push
        and raises it. On another broker it is sent before this returns (errors raised here).
        With tracing on, the request's ``asyncinfer.submit`` span (client/submit_span.py) starts
        here and ends with its future."""
        lane = self.lane_of(outgoing)
        if lane is not self:
            return lane.send_watched(outgoing)
        if self.tracing is None:
            return self._send_watched(outgoing)
        span = start_submit_span(self.tracing, outgoing)
        try:
            future = self._send_watched(outgoing)
        except BaseException as exc:
            end_with_error(self.tracing, span, exc)
            raise
        end_with_future(self.tracing, span, future)
        return future

    def deadline_clock(self, outgoing: Outgoing) -> None:
        """Before a request with an ``expires`` is written: this process' offset from the
        broker's clock is known (the deadline is set on the broker's clock: wire/clock.py)."""
        if outgoing.expires is not None and self.broker is not None:
            CLOCK_FOLLOWER.measured(self.broker)

    def _send_watched(self, outgoing: Outgoing) -> InferFuture:
        if self.grouped is None:
            future = self.watched(outgoing)
            try:
                self._send(outgoing)
            except BaseException:  # this future waits for a request it did not send
                self.watcher.unwatch(outgoing.request_id, future._settle)
                raise
            return future
        assert self._publisher is not None
        self.deadline_clock(outgoing)
        push = self._publisher.prepare(
            message=outgoing.message(self.watcher.channel, self.settings.max_payload_bytes),
            **self.publish_options(outgoing))
        future = self.watched(outgoing)
        future._sending_in_group()
        try:
            # A future cancelled before its group goes (a gateway call given up on) withdraws
            # its request: it is never sent.
            self.grouped.put(push, functools.partial(self._group_sent, outgoing, future),
                             withdrawn=future.cancelled)
        except BaseException:
            self.watcher.unwatch(outgoing.request_id, future._settle)
            raise
        return future

    def _group_sent(self, outgoing: Outgoing, future: InferFuture, status: int | None,
                    error: BaseException | None) -> None:
        """What the group publisher tells of ``outgoing``'s request."""
        if error is None:
            assert status is not None
            self.sent(outgoing, status)
        else:  # refused: this future stops waiting, another waiter of the ID (the accepted
            # request of a reused ID) goes on
            self.watcher.unwatch(outgoing.request_id, future._settle)
        future._sent(error)

    def _publish_error(self, request_id: str, exc: redis.RedisError) -> AsyncInferError:
        return self.broker_error(broker_error(request_id, exc))

    def watched(self, outgoing: Outgoing) -> InferFuture:
        """The future of ``outgoing``'s request, watched on this sender's reply channel (before
        it is sent, so its answer cannot come first)."""
        lane = self.lane_of(outgoing)
        if lane is not self:
            return lane.watched(outgoing)
        future = self.future_of(outgoing.request_id)
        self.watcher.watch(outgoing.request_id, future._settle, announced=True)
        return future

    def future_of(self, request_id: str) -> InferFuture:
        """A future of ``request_id``, not yet watched."""
        return InferFuture(request_id, self.app, self.watcher, self.store)

    @property
    def store(self) -> TensorStore | None:
        """The tensor store (``ASYNCINFER_TENSOR_STORE_URL``; None: none), opened on first use."""
        if self._store is _UNOPENED:
            self._store = store_from_settings(self.settings)
        return self._store  # type: ignore[return-value]

    def _send(self, outgoing: Outgoing) -> None:
        """Send with Celery's ``send_task`` (a broker other than Redis)."""
        request_id = outgoing.request_id
        if outgoing.sequence is not None:  # its routing is the Redis publish script's
            raise InvalidRequest(f"request {request_id}: sequence batching (parameter "
                                 f"'sequence_id') needs a Redis broker")
        timeout_s = (self.settings.submit_timeout_s if outgoing.timeout_s is None
                     else outgoing.timeout_s)
        try:
            blocked = self._publish_blocked(timeout_s)
            if blocked is not None:
                # Written, it would wait in the socket until the alarm clears: a submit that
                # says it was sent while the broker has not taken it, and runs whenever that is.
                waited = f", after waiting {timeout_s:g} s for it to lift" if timeout_s > 0 else ""
                raise BrokerRefused(
                    f"request {request_id}: RabbitMQ blocks publishing ({blocked}: a memory or "
                    f"disk alarm is raised on the broker, which takes no message until it "
                    f"clears); not sent{waited} (timeout_s, default submit_timeout_s)")
            if outgoing.claim and not claim_on_backend(
                    self.app.backend.client, outgoing, self.watcher.key(outgoing.request_id),
                    max(1, int(self.settings.result_expires_s or 86400))):
                # already sent, perhaps by another producer: wait on its own channel
                self.watcher.watch_own_channel(request_id)
                return
        except OperationalError as exc:  # kombu's: unreachable, refused
            raise self.broker_error(BrokerUnavailable(
                f"request {request_id}: the broker did not take it ({exc}); not sent")) from exc
        try:
            self.app.send_task(outgoing.task, **outgoing.send_task_options(self.watcher.channel))
        except BaseException as exc:
            sent_maybe = _timed_out(exc)
            if outgoing.claim and not sent_maybe:  # the ID may be sent again: not claimed
                release_claim(self.app.backend.client, outgoing)
            if not isinstance(exc, OperationalError):
                raise
            # kombu's: unreachable, refused, or a write timed out
            maybe = ("it may have been sent all the same (a broker that stops reading times a "
                     "write out: RabbitMQ during a memory or disk alarm, a network partition)"
                     if sent_maybe else "not sent")
            raise self.broker_error(BrokerUnavailable(
                f"request {request_id}: the broker did not take it ({exc}); {maybe}")) from exc

    def _publish_blocked(self, wait_s: float) -> str | None:
        """Why the broker blocks publishing on the connection the next send takes from the pool
        (RabbitMQ during a memory or disk alarm), waiting up to ``wait_s`` for it to lift; None
        when it does not. (Told after the producer went back: an error inside its block would
        close the connection, which a blocked broker does not answer.)"""
        with self.app.producer_or_acquire() as producer:
            return publish_blocked(producer.connection, wait_s=wait_s)

    def publish_options(self, outgoing: Outgoing) -> dict[str, Any]:
        """The publisher's arguments for ``outgoing`` (all but its message)."""
        return {"queue": outgoing.queue, "model": outgoing.model, "request_id": outgoing.request_id,
                "claim": outgoing.claim, "identity": outgoing.identity(),
                "priority": outgoing.priority,
                "result_key": (self.watcher.key(outgoing.request_id) if self._results_shared
                               else None),
                "max_queue_size": self._model_options(outgoing.model).max_queue_size,
                "level_max_queue_size": self._model_options(outgoing.model).level_policy(
                    outgoing.priority).max_queue_size,
                "timeout_s": (self.settings.submit_timeout_s if outgoing.timeout_s is None
                              else outgoing.timeout_s),
                "sequence": outgoing.sequence,
                **self._cache_options(outgoing)}

    def _cache_options(self, outgoing: Outgoing) -> dict[str, Any]:
        """The response cache's part of the publish (broker/response_cache.py): the request's key and
        reply channel, when its model caches answers and they are stored on the broker (where
        the publish script reads the cache); nothing otherwise."""
        model = outgoing.model
        if not (model and self._results_shared and outgoing.task == TASK_NAME
                and self._model_options(model).response_cache):
            return {}
        key = cache_key(model, outgoing.kwargs)
        return {"cache_key": key, "reply_to": self.watcher.channel} if key else {}

    def sent(self, outgoing: Outgoing, status: int) -> None:
        """After the publish: a request ID sent before (perhaps by another producer, whose reply
        channel is not this one) is watched on its own channel. The request is judged by the
        lost check from now on (its trace was written by this publish, or by the first's)."""
        if status == DUPLICATE:
            self.watcher.watch_own_channel(outgoing.request_id)
        self.watcher.trace(outgoing.request_id, seen=status != DUPLICATE)

    def broker_error(self, error: AsyncInferError) -> AsyncInferError:
        """``error``, saying so when the broker URL was the default for want of any other."""
        if not (self._broker_guessed and isinstance(error, BrokerUnavailable)):
            return error
        return BrokerUnavailable(f"{error} (no broker configured: ASYNCINFER_BROKER_URL is unset and "
                                 f"no 'asyncinfer up' runs on this host, so the default "
                                 f"{DEFAULT_BROKER_URL} was tried)")

    def _model_options(self, model: str | None) -> ModelOptions:
        """The options of ``model`` (read once per model; None, a queue of no model: the
        defaults)."""
        options = self._options.get(model)
        if options is None:
            options = self.settings.options_for(model, ModelOptions()) if model else ModelOptions()
            self._options[model] = options
        return options

    def close(self) -> None:
        """Send what is still pending, stop the result watcher and close the broker's
        connections."""
        if self.grouped is not None:
            self.grouped.close()
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        if self.broker is not None:
            self.broker.close()
        if self.tracing is not None:
            self.tracing.close()
        for lane in self.lanes[1:]:
            lane.close()


def _skip_on_task_call(producer: Any, task_id: str) -> None:
    return None


def _timed_out(exc: BaseException | None) -> bool:
    """Whether ``exc`` or what caused it is a timeout (kombu says so in words)."""
    for _ in range(8):  # a chain, not a cycle
        if exc is None:
            return False
        if isinstance(exc, TimeoutError) or "timed out" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
