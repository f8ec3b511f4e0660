"""Producer API: submit requests, get futures, look results up by request ID from any process.

    from asyncinfer import Client
    with Client() as client:
        future = client.submit("mlp", np.ones((2, 16), np.float32))
        print(future.result(timeout=10)["output"])
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import redis
from celery import Celery

from asyncinfer.broker.catalogue import CatalogueEntry
from asyncinfer.broker.fleet_stats import triton_stats
from asyncinfer.client.async_calls import AsyncCalls
from asyncinfer.client.brokers import BrokerGroup, RoutedGroups
from asyncinfer.client.jobs.windowed import DEFAULT_WINDOW, windowed
from asyncinfer.client.loop_publisher import LoopPublishers
from asyncinfer.client.model_control import ModelControl
from asyncinfer.client.outgoing import Outgoing, input_payloads
from asyncinfer.client.request_lookup import LOOK_GAP_S, look_up, refuse_unknown
from asyncinfer.client.responses import InferFuture, InferResponse
from asyncinfer.client.result_watcher import ResultWatcher
from asyncinfer.client.sender import Sender
from asyncinfer.client.streaming import Streaming
from asyncinfer.client.streams import Streams
from asyncinfer.client.submit_span import end_with_error, end_with_future, start_span_for
from asyncinfer.client.whereabouts import whereabouts
from asyncinfer.config.settings import Settings
from asyncinfer.constants import (
    CPU_QUEUE,
    POSTPROCESS_TASK,
    PREPROCESS_TASK,
    TASK_NAME,
    queue_for,
)
from asyncinfer.errors import AsyncInferError, RequestTimeout, RequestUnknown
from asyncinfer.wire.messages import uuid4_text
from asyncinfer.wire.model_versions import PARAMETER

if TYPE_CHECKING:
    from asyncinfer.client.jobs.runner import JobResult

__all__ = ["Client"]


# Its model control (client/model_control.py), streaming responses (client/streaming.py) and
# asyncio calls (client/async_calls.py) are its parts' modules.
class Client(ModelControl, Streaming, AsyncCalls):
    """Sends ``asyncinfer.infer`` requests and waits for their results.

    With a routing table (``ASYNCINFER_BROKER_ROUTES``) one client serves every broker of it:
    each call goes to its model's broker (a Celery app, sender and result watcher per broker,
    made when a model routed there is first used); :meth:`models` merges their catalogues. A
    lookup by request ID alone (:meth:`future`, :meth:`result`) cannot know the model: pass
    ``model=``, or keep every result on one backend (``ASYNCINFER_RESULT_BACKEND``).

    Args:
        broker_url: default ``ASYNCINFER_BROKER_URL`` (or what ``asyncinfer up`` published); with
            routes, the broker of the models no route names.
        result_backend: default ``ASYNCINFER_RESULT_BACKEND``, else the broker URL (with routes:
            each route's broker URL).
        serializer: ``json`` (flat lists on the wire) or ``msgpack`` (raw bytes).
        settings: full settings instead of the environment.
    """

    def __init__(self, broker_url: str | None = None, result_backend: str | None = None, *,
                 serializer: str | None = None, settings: Settings | None = None) -> None:
        self.settings = settings or Settings.from_env(
            broker_url=broker_url, result_backend=result_backend, task_serializer=serializer)
        routes = self.settings.routes() if self.settings.broker_routes else None
        #: The default broker's app, catalogue and sender (the only ones without routes).
        self._group = BrokerGroup(
            self.settings.for_broker(routes.default_url) if routes else self.settings)
        self.app: Celery = self._group.app
        #: What every submit, blocking or asyncio, stands on (client/sender.py); the default
        #: broker's with routes (:meth:`sender_for` names a model's).
        self.sender: Sender = self._group.sender
        self._broker = self.sender.broker
        #: Every broker's group (None: one broker, and no lookup per call).
        self._routes = RoutedGroups(routes, self.settings, self._group) if routes else None
        #: Each broker group's streams (client/streams.py), made on first use.
        self._streams: dict[int, Streams] = {}
        self._streams_lock = threading.Lock()

    def sender_for(self, model: str) -> Sender:
        """The sender of ``model``'s broker (:attr:`sender` without routes)."""
        return self.sender if self._routes is None else self._routes.for_model(model).sender

    def app_for(self, model: str) -> Celery:
        """The Celery app of ``model``'s broker (:attr:`app` without routes)."""
        return self._group_for(model).app

    def apps(self) -> dict[str, Celery]:
        """Broker URL → Celery app of every broker the client serves: the one broker's, or with
        routes each broker of the table's (the default's first)."""
        if self._routes is None:
            return {self.settings.resolved_broker_url(): self.app}
        return {url: self._routes.for_url(url).app for url in self._routes.routes.urls()}

    def _group_for(self, model: str | None) -> BrokerGroup:
        if self._routes is None or model is None:
            return self._group
        return self._routes.for_model(model)

    @property
    def broker(self) -> redis.Redis | None:
        """The Redis client of the broker (None on another broker)."""
        return self._broker

    @property
    def loop_publishers(self) -> LoopPublishers:
        """Where coroutines publish small requests themselves (aio.send_on_loop)."""
        return self.sender.loop_publishers

    def models(self, *, stale_ok: bool = False) -> dict[str, CatalogueEntry]:
        """The model catalogue: every model the fleet announced within ``model_retention_s``,
        with its metadata and the live workers hosting it (``entry.ready``: at least one).

        With routes, every broker's merged; ``stale_ok``: a broker that does not answer gives
        its catalogue as last read, and the error is raised only when none answers."""
        if self._routes is not None:
            return self._routes.models(stale_ok=stale_ok)
        return self._group.models()

    def statistics(self, model: str | None = None) -> list[dict[str, Any]]:
        """The fleet's inference statistics in Triton's form (``model_stats``, broker/fleet_stats.py):
        of ``model``, or of every model with counts or in the catalogue."""
        if model is not None:
            return self._group_for(model).statistics(model)
        found: dict[str, dict[str, Any]] = {}
        for group in [self._group] if self._routes is None else self._routes.every():
            for stats in group.statistics():
                found.setdefault(stats["name"], stats)  # a model's own broker first
        for name in self.models():  # those no worker counted yet: zeros
            found.setdefault(name, triton_stats(name, []))
        return [found[name] for name in sorted(found)]

    def knows_now(self, model: str) -> bool:
        """Whether :meth:`check_model` can judge ``model`` without reading the catalogue."""
        return self.sender_for(model).knows_now(model)

    def check_model(self, model: str, request_id: str = "") -> None:
        """Raise :class:`~asyncinfer.errors.UnknownModel` when the fleet has announced models, but
        not ``model``, within ``model_retention_s`` (0: never). A known model with no live worker
        passes: its requests wait in its queue for one."""
        self.sender_for(model).check_model(model, request_id)

    @property
    def watcher(self) -> ResultWatcher:
        """The result watcher (started on first use)."""
        return self.sender.watcher

    def submit(self, model: str, inputs: Any, *, request_id: str | None = None,
               parameters: Mapping[str, Any] | None = None, serializer: str | None = None,
               binary: bool | None = None, link: Any = None, link_error: Any = None,
               expires: float | None = None, timeout_s: float | None = None,
               soft_time_limit_s: float | None = None,
               time_limit_s: float | None = None, priority: int | None = None,
               version: str | int | None = None) -> InferFuture:
        """Send one request and return its future at once, before the request is on its queue.

        On a Redis broker the client's publisher thread sends every request handed to it while
        its last round trip was out in one group (client/grouped.py): a producer far from Redis
        keeps many requests in flight from one thread. ``future.sent()`` waits until this one is
        on its queue, and raises what refused it — the blocking form of a submit:
        ``client.submit(...).sent()``. A refusal is the future's outcome too (``result()`` raises
        it). Bad input, an unknown model or a payload over its limit raise here, at once.

        Args:
            model: a registered model; the request goes to queue ``infer.<model>``.
            inputs: a mapping of input name → value, or one value (named ``input``). Values may
                be numpy arrays, torch tensors, (nested) lists, strings or bytes.
            request_id: the request (task) ID; default a new UUID.
            parameters: the v2 request's ``parameters`` (``{"response_cache": False}``: neither
                read nor fill the model's response cache, docs/operations.md).
            serializer: ``json`` or ``msgpack``; default the client's.
            binary: send tensor data as raw bytes; default True for msgpack, False for json.
            link, link_error: Celery signatures called with the result or on failure.
            expires: seconds after which a request not yet started is not run.
            timeout_s: when the model's queue is at its ``max_queue_size``, wait up to this long
                for room, then raise :class:`~asyncinfer.errors.QueueFull`; on RabbitMQ, while
                the broker blocks publishing (a memory or disk alarm), wait up to this long for
                it to lift, then raise :class:`~asyncinfer.errors.BrokerRefused`; default the
                ``submit_timeout_s`` setting (0: raise at once).
            soft_time_limit_s, time_limit_s: Celery's ``soft_time_limit`` and ``time_limit`` for
                this request; default the worker's.
            priority: Celery's message priority, 0 to 9; on Redis (Celery's Redis semantics) 0 is
                served first, in steps 0, 3, 6, 9, and a worker forms its next device batch from
                the best level it holds (docs/delivery.md, *Priorities*). Default 0. A level's
                ``priority_queue_policy`` may bound it (QueueFull) and give it a default
                ``expires``.
            version: the model version to run it (parameter ``model_version``); default the
                latest version the worker that takes it hosts.

        A ``request_id`` that was already sent is not sent again: the future is that request's.
        Raises :class:`~asyncinfer.errors.UnknownModel` for a model the fleet never announced
        (see :meth:`check_model`), and :class:`~asyncinfer.errors.InvalidRequest`, in the words
        its worker would use, for inputs that do not fit those the model declared in the
        catalogue (names, datatypes, shapes: client/input_check.py); nothing is sent then.
        Refusals, through the future (``sent()``, ``result()``):
        :class:`~asyncinfer.errors.QueueFull` (the queue stayed at its ``max_queue_size`` for
        ``timeout_s``), :class:`~asyncinfer.errors.BrokerUnavailable` and
        :class:`~asyncinfer.errors.BrokerRefused` (the broker unreachable, refusing the write,
        or RabbitMQ blocking publishers),
        :class:`~asyncinfer.errors.InvalidRequest` (``request_id`` already sent to another
        model), :class:`~asyncinfer.errors.NotReplicated` (``ASYNCINFER_SUBMIT_REPLICAS``).
        """
        if version is not None and str(version):
            parameters = {**(parameters or {}), PARAMETER: str(version)}
        sender = self.sender if self._routes is None else self._routes.for_model(model).sender
        return sender.send_watched(sender.submission(
            model, inputs, request_id=request_id, parameters=parameters, serializer=serializer,
            binary=binary, link=link, link_error=link_error, expires=expires, timeout_s=timeout_s,
            soft_time_limit_s=soft_time_limit_s, time_limit_s=time_limit_s, priority=priority))

    def submission(self, model: str, inputs: Any, *, request_id: str | None = None,
                   parameters: Mapping[str, Any] | None = None, serializer: str | None = None,
                   binary: bool | None = None, check: bool = True, **options: Any) -> Outgoing:
        """The request :meth:`submit` would send, checked and not yet sent (``check``: the
        unknown-model check and the inputs' against the model's declared ones too)."""
        return self.sender_for(model).submission(
            model, inputs, request_id=request_id, parameters=parameters, serializer=serializer,
            binary=binary, check=check, **options)

    def submit_staged(self, model: str, inputs: Any, *, request_id: str | None = None,
                      parameters: Mapping[str, Any] | None = None, serializer: str | None = None,
                      cpu_queue: str = CPU_QUEUE) -> InferFuture:
        """Send a request as three Celery tasks in a chain: ``asyncinfer.preprocess`` on
        ``cpu_queue`` → ``asyncinfer.infer`` on ``infer.<model>`` (forward only, batched) →
        ``asyncinfer.postprocess`` on ``cpu_queue``. The future resolves to the final response;
        ``request_id`` is the ID of the last task.
        """
        serializer = serializer or self.settings.task_serializer
        binary = serializer == "msgpack"
        request_id = request_id or uuid4_text()
        self.check_model(model, request_id)
        payload = {"model": model, "inputs": input_payloads(inputs, binary),
                   "parameters": dict(parameters or {})}
        options: dict[str, Any] = {"serializer": serializer}
        group = self._group_for(model)  # with routes, the CPU stages run on the model's broker too
        tracing, span = group.sender.tracing, None
        if tracing is not None:  # every stage's message carries the chain's one span
            span = start_span_for(tracing, request_id, cpu_queue, PREPROCESS_TASK, model)
            options["headers"] = tracing.fields_of(span)
        app = group.app
        flow = (app.signature(PREPROCESS_TASK, kwargs=payload, queue=cpu_queue, **options)
                | app.signature(TASK_NAME, queue=queue_for(model), **options)
                | app.signature(POSTPROCESS_TASK, queue=cpu_queue, task_id=request_id, **options))
        future = group.sender.future_of(request_id)
        group.sender.watcher.watch(request_id, future._settle)
        try:
            flow.apply_async()
        except BaseException as exc:
            if span is not None:
                end_with_error(tracing, span, exc)
            raise
        if span is not None:
            end_with_future(tracing, span, future)
        return future

    def send(self, task: str, queue: str, kwargs: dict[str, Any], *, request_id: str | None = None,
             claim: bool | None = None, serializer: str | None = None, link: Any = None,
             link_error: Any = None, expires: float | None = None, timeout_s: float | None = None,
             soft_time_limit_s: float | None = None, time_limit_s: float | None = None,
             priority: int | None = None) -> InferFuture:
        """Send any task by name with ``kwargs`` to ``queue``; its future resolves to its result.

        :meth:`submit` is this for ``asyncinfer.infer``. On a Redis broker the message is one
        script call (idempotency claim, queue bound, LPUSH of what ``send_task`` would publish);
        on other brokers it is ``send_task`` (the queue bound is then the broker's own, e.g.
        RabbitMQ's ``x-max-length``).
        """
        if claim is None:
            claim = request_id is not None  # generated IDs cannot collide
        sender = self.sender if self._routes is None else self._routes.for_queue(queue).sender
        return sender.send_watched(Outgoing(
            task, queue, kwargs, uuid4_text() if request_id is None else request_id, claim,
            serializer or self.settings.task_serializer, link=link, link_error=link_error,
            expires=expires, timeout_s=timeout_s, soft_time_limit_s=soft_time_limit_s,
            time_limit_s=time_limit_s, priority=priority or 0))

    def watched(self, outgoing: Outgoing) -> InferFuture:
        """The future of ``outgoing``'s request, watched on this client's reply channel (before
        it is sent, so its answer cannot come first)."""
        if self._routes is None:
            return self.sender.watched(outgoing)
        return self._routes.for_queue(outgoing.queue).sender.watched(outgoing)

    def _broker_error(self, error: AsyncInferError) -> AsyncInferError:
        """``error``, saying so when the broker URL was the default for want of any other."""
        return self.sender.broker_error(error)

    def ping(self) -> None:
        """Raise :class:`~asyncinfer.errors.BrokerUnavailable` (one line, within about
        ``connect_timeout_s``) unless the broker and the result backend answer (with routes:
        every broker of the table, the error naming the one that did not)."""
        if self._routes is not None:
            self._routes.ping()
        else:
            self._group.ping()

    def infer(self, model: str, inputs: Any, *, timeout_s: float | None = None,
              **options: Any) -> InferResponse:
        """Send one request and wait for its response."""
        return self.submit(model, inputs, **options).result(timeout=timeout_s)

    def map(self, model: str, inputs: Iterable[Any], *, timeout_s: float | None = None,
            window: int = DEFAULT_WINDOW, progress: bool | None = False,
            **options: Any) -> Iterator[InferResponse]:
        """Send a request per input (in groups), at most ``window`` unanswered at a time, and
        yield the responses in input order: the first while later ones are still being sent,
        memory bounded by the window (client/jobs/windowed.py). ``progress``: a bar on stderr (rows
        done, rows/s, time left; None: when stderr is a terminal). A request refused
        (``QueueFull``, say) raises its error at its turn; ``timeout_s`` is each answer's wait."""
        watcher = self.sender_for(model).watcher
        return windowed(lambda one: self.submit(model, one, **options), inputs, window=window,
                        timeout_s=timeout_s, progress=progress, description=model,
                        forget=lambda future: watcher.unwatch(future.id, future._settle))

    def run_job(self, model: str, input: str | os.PathLike[str], output: str | os.PathLike[str],
                **options: Any) -> JobResult:
        """Every row of the file ``input`` through ``model``, written to ``output`` beside the
        row's columns in the same order; resumable under ``job_id`` (asyncinfer/client/jobs/runner.py's
        ``run_job`` takes the options; docs/jobs.md)."""
        from asyncinfer.client.jobs.runner import run_job

        return run_job(self, model, input, output, **options)

    def future(self, request_id: str, *, model: str | None = None) -> InferFuture:
        """The future of a request sent by anyone, looked up by its ID (with routes, on the
        broker of ``model``; without a model, the default broker's)."""
        sender = self._group_for(model).sender.lane(request_id)
        future = sender.future_of(request_id)
        sender.watcher.watch(request_id, future._settle)
        if sender.broker is not None:  # judged only if a look finds its trace
            sender.watcher.trace(request_id, seen=False)
        return future

    def result(self, request_id: str, timeout_s: float | None = None, *,
               model: str | None = None) -> InferResponse:
        """Wait for the response of the request ``request_id``.

        With routes, the result is on the broker of the request's ``model`` (without one: the
        default broker's, or the one result backend that ``ASYNCINFER_RESULT_BACKEND`` names).

        Raises :class:`~asyncinfer.errors.BrokerUnavailable` at once when Redis does not answer;
        :class:`~asyncinfer.errors.RequestUnknown` within about a second when nothing exists for
        the ID in Redis (client/request_lookup.py; with routes, only when ``model`` names the
        broker); after ``timeout_s``, :class:`~asyncinfer.errors.RequestTimeout` saying where the
        request is (queued, taken by a worker, running on which worker, or unknown).
        """
        group = self._group_for(model)
        group.ping()
        future = self.future(request_id, model=model)
        began_s = time.monotonic()
        sender = group.sender.lane(request_id)  # its shard's, on a cluster that spreads requests
        try:
            if self._routes is None or model is not None:  # else another broker may hold it
                backend, broker = sender.app.backend, sender.broker
                refuse_unknown(request_id, lambda: look_up(request_id, backend.client, backend, broker),
                               future, LOOK_GAP_S if timeout_s is None else min(LOOK_GAP_S, timeout_s))
            left_s = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - began_s))
            return future.result(timeout=left_s)
        except RequestUnknown:
            sender.watcher.unwatch(request_id, future._settle)
            raise
        except RequestTimeout:
            sender.watcher.unwatch(request_id, future._settle)
            try:
                where = whereabouts(request_id, sender.app.backend.client, sender.app.backend,
                                    sender.broker)
            except redis.RedisError as exc:
                where = f"where it is could not be read ({type(exc).__name__}: {exc})"
            raise RequestTimeout(f"request {request_id}: no result within {timeout_s:g} s; "
                                 f"{where}") from None

    async def aclose(self) -> None:
        """:meth:`close` from a coroutine (also closes the running loop's own connections)."""
        for group in self._groups():
            await group.sender.loop_publishers.aclose()
        for streams in list(self._streams.values()):
            await streams.aclose()
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """Stop the result watcher and release connections (every broker's, with routes)."""
        with self._streams_lock:
            streams, self._streams = list(self._streams.values()), {}
        for one in streams:
            one.close()
        for group in self._groups():
            group.close()

    def _groups(self) -> list[BrokerGroup]:
        """Every broker group made so far."""
        return [self._group] if self._routes is None else self._routes.made()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
