"""Celery's consumer, answering the messages it refuses instead of dropping them silently.

A message whose content type is not accepted (pickle, say) is never deserialized; Celery logs it
and drops it. Here its request also gets a FAILURE that says why, so the producer is not left
waiting for a result that will never come. A message body over ``ASYNCINFER_MAX_PAYLOAD_BYTES``
is refused the same way, before anything decodes it.

In a device worker (one that reads ``infer.*`` queues or the control queue) only the tasks
:mod:`asyncinfer.policy.task_policy` allows run: every other task name — Celery's built-ins
included — is answered with a FAILURE under its ID and acknowledged before Celery creates a
request for it, so it never runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from celery import states
from celery.app.task import Context
from celery.worker.consumer import Consumer as CeleryConsumer
from kombu.exceptions import ContentDisallowed, DecodeError

from asyncinfer.backoff import Backoff
from asyncinfer.broker import transport
from asyncinfer.broker.refusals import refusal_reason
from asyncinfer.config.bound import settings_of
from asyncinfer.constants import PREPROCESS_TASK, TASK_NAME, model_from_queue
from asyncinfer.errors import InvalidRequest
from asyncinfer.policy.task_policy import TaskPolicy
from asyncinfer.wire.envelope import (
    payload_too_large,
    printable,
    protocol2_body,
    refused_content,
    undecodable_body,
)
from asyncinfer.wire.reply import REPLY_TO, reply_channel_of
from asyncinfer.worker.bootstrap import hosted_models
from asyncinfer.worker.consumers.consumer import PipelineConsumer, body_cut_bytes
from asyncinfer.worker.consumers.kombu_intake import KombuIntake
from asyncinfer.worker.lifecycle import FAILED_FORMAT
from asyncinfer.worker.step import is_prefork
from asyncinfer.worker.worker import existing_worker, worker_of

__all__ = ["Consumer"]

log = logging.getLogger(__name__)


class Consumer(CeleryConsumer):  # type: ignore[misc]
    """Celery's consumer plus a FAILURE result for every refused message that has an ID."""

    _policy_key: frozenset[str] | None = None
    _policy: TaskPolicy | None = None
    _refused_at = 0.0
    _refusal_backoff: Backoff | None = None
    #: The pipeline's messages kombu delivered in this turn of the event loop, handed over
    #: together when it ends (:meth:`_hand_over`).
    _handing: list[Any] | None = None

    @property
    def _refusals(self) -> Backoff:
        """How long to wait after Redis' refusals in a row (this consumer's own)."""
        if self._refusal_backoff is None:
            self._refusal_backoff = Backoff()
        return self._refusal_backoff

    def _refuse(self, message: Any, exc: Exception, request_id: Any = None) -> None:
        headers = message.headers or {}
        request_id = request_id or headers.get("id")
        if not isinstance(request_id, str) or not request_id:
            return
        if isinstance(exc, ContentDisallowed):
            error = refused_content(request_id, message.content_type)
        elif isinstance(exc, InvalidRequest):
            error = exc
        elif isinstance(exc, DecodeError):  # kombu's, wrapping what the decoder raised
            cause = exc.args[0] if exc.args and isinstance(exc.args[0], BaseException) else exc
            error = undecodable_body(request_id, message.content_type, cause)
        else:
            error = InvalidRequest(f"request {request_id}: the message breaks the task protocol "
                                   f"({type(exc).__name__}: {exc})")
        self._store_failure(request_id, error, headers)

    def _store_failure(self, request_id: str, error: Exception, headers: Mapping[str, Any]) -> None:
        try:
            reply_to = reply_channel_of(headers)
            self.app.backend.store_result(request_id, error, states.FAILURE,
                                          request=Context({REPLY_TO: reply_to}) if reply_to else None)
        except Exception:  # noqa: BLE001 - the message is dropped either way; say so
            log.exception("request %s: could not store the refusal", printable(request_id))

    def on_connection_error_before_connected(self, exc: Exception) -> None:
        if not self._refused(exc):
            super().on_connection_error_before_connected(exc)

    def on_connection_error_after_connected(self, exc: Exception) -> None:
        # What the lost loop delivered and had not handed over: its hand-over was a callback of
        # that loop, and kombu's hub, closing, drops the callbacks after one that raises (a read
        # of the dead socket does): left waiting, nothing delivered later would be handed over
        self._hand_over_all()
        if not self._refused(exc):
            super().on_connection_error_after_connected(exc)
        device_worker = existing_worker(self.app)
        consumer = device_worker.consumer if device_worker is not None else None
        if consumer is not None:  # before Celery connects again
            consumer.kombu_connection_lost()

    def _refused(self, exc: Exception) -> bool:
        """When Redis refused (a full disk, say: its refusals are connection errors of the
        project's transport), say so and wait before Celery starts the consumer again, longer
        each time in a row (0.1 s doubling to 5 s). True when it was a refusal."""
        reason = refusal_reason(exc)
        if reason is None:
            return False
        now = time.monotonic()
        if now - self._refused_at > 60:  # not in a row: from the first wait again
            self._refusals.reset()
        self._refused_at = now
        wait_s = self._refusals.failed()
        log.warning("consumer: Redis refused: %s; starting again in %.1f s", reason, wait_s)
        time.sleep(wait_s)
        return True

    def connect(self) -> Any:
        """Celery's connection, whose Redis transport (:mod:`asyncinfer.broker.transport`) answers here
        the malformed messages it drops."""
        conn = super().connect()
        if isinstance(conn.transport, transport.Transport):
            conn.transport.on_malformed = self._answer_malformed
        return conn

    def _answer_malformed(self, request_id: str, error: InvalidRequest, headers: Mapping[str, Any],
                          queue: str) -> None:
        """Log and store the FAILURE of a malformed message the transport dropped."""
        log.warning(FAILED_FORMAT, printable(request_id), model_from_queue(queue) or queue,
                    self.hostname, type(error).__name__, printable(error, 1000))
        self._store_failure(request_id, error, headers)

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Any:
        handle = super().create_task_handler(*args, **kwargs)
        settings = settings_of(self.app)
        limit = int(settings.max_payload_bytes) if settings is not None else 0
        forks = is_prefork(getattr(self.controller, "pool_cls", "threads"))
        consumed = self.app.amqp.queues.consume_from or {}
        if not forks and any(model_from_queue(name) is not None for name in consumed):
            self._pipeline()  # made now, not at the first request: it says so in the log

        def on_task_received(message: Any) -> Any:
            if _for_the_pipeline(message):
                if forks:
                    request_id = (message.headers or {}).get("id")
                    self._answer_refused(message, request_id, InvalidRequest(
                        f"request {printable(request_id)}: {TASK_NAME} is refused by a worker "
                        f"whose pool forks (prefork): a model runs in the process that owns its "
                        f"device — run the threads or solo pool (asyncinfer worker)"))
                    return None
                return self._hand_over(message)  # the one pipeline, whatever took it
            body = message.body
            size = body_cut_bytes(message) or (len(body) if isinstance(body, (bytes, str)) else 0)
            if limit and size > limit:
                request_id = (message.headers or {}).get("id")
                self._answer_refused(message, request_id,
                                     payload_too_large(str(request_id or "?"), size, limit))
                return None
            if not self._well_formed(message):
                return None
            policy = self._task_policy()
            if policy is not None and self._refused_by(policy, message):
                return None
            return handle(message)

        return on_task_received

    def _hand_over(self, message: Any) -> None:
        """Hand ``message`` to the pipeline with the others kombu delivers in this turn of the
        event loop (what one take popped), once it ends: started together, they cost one round
        trip for their STARTED states, not one each, and the channel takes again sooner — a
        high-priority message waits in Redis while the loop hands over the take before it (at a
        message each, 128 of them took ~100 ms: ten small batches). Without an event loop, at
        once."""
        hub = self.hub
        if hub is None:
            self._pipeline().received([message])
            return
        if self._handing is None:
            self._handing = []
        self._handing.append(message)
        if len(self._handing) == 1:
            hub.call_soon(self._hand_over_all)

    def _hand_over_all(self) -> None:
        """(The event loop, after the turn that delivered them.) Hand over what waits."""
        messages, self._handing = self._handing or [], []
        if messages:
            self._pipeline().received(messages)

    def _pipeline(self) -> PipelineConsumer:
        """The consumer of this worker's pipeline: its fast consumer (an ``asyncinfer.infer``
        on a stage queue, say), else its kombu intake, made at the first request (it outlives
        reconnections; worker/step.py or the worker's close stops it)."""
        device_worker = worker_of(self.app)
        consumer = device_worker.consumer
        if consumer is None:
            consumer = KombuIntake(self.app, device_worker.runtime, hostname=self.hostname,
                                   policy=device_worker.policy,
                                   send_events=bool(getattr(self.controller, "task_events", False)),
                                   tracing=device_worker.tracing)
            device_worker.serving(consumer)
        if consumer.kombu_qos is None:
            celery_consumer = self
            consumer.kombu_qos = lambda: getattr(celery_consumer, "qos", None)
        return consumer

    def _well_formed(self, message: Any) -> bool:
        """Whether a task message's body is what task protocol 2 says, ``[args, kwargs, embed]``
        (Celery's tracer would fail it without storing a result); one that is not is answered as
        the fast consumer answers it. The decoded body is kept for Celery (kombu caches it)."""
        headers = message.headers or {}
        if "task" not in headers:
            return True  # protocol 1: Celery's own rules
        try:
            protocol2_body(str(headers.get("id") or "?"), message.decode())
        except InvalidRequest as error:
            self._answer_refused(message, headers.get("id"), error)
            return False
        except Exception as exc:  # noqa: BLE001 - answered as Celery answers it, refused unrun
            self.on_decode_error(message, exc)
            return False
        return True

    def _answer_refused(self, message: Any, request_id: Any, error: InvalidRequest) -> None:
        """Log, store the FAILURE of (when it names its request) and acknowledge a message that is
        refused unrun."""
        queue = (message.delivery_info or {}).get("routing_key") or ""
        log.warning(FAILED_FORMAT, request_id or "?", model_from_queue(queue) or queue,
                    self.hostname, type(error).__name__, error)
        self._refuse(message, error, request_id)
        message.ack()

    def _task_policy(self) -> TaskPolicy | None:
        """The tasks this worker serves (None: not a device worker), for the queues it reads now
        (remote control may add or cancel queues)."""
        consumed = self.app.amqp.queues.consume_from or {}
        key = frozenset(consumed)
        if key != self._policy_key:
            routes = {name: name for name in consumed}
            routes.update({q.routing_key: name for name, q in consumed.items() if q.routing_key})
            self._policy = TaskPolicy.for_worker(routes, hosted_models(self.app))
            self._policy_key = key
        return self._policy

    def _refused_by(self, policy: TaskPolicy, message: Any) -> bool:
        """Refuse ``message`` if ``policy`` does not serve its task; True when it was refused."""
        headers = message.headers or {}
        task, request_id, payload = headers.get("task"), headers.get("id"), None
        if task is None:  # protocol 1: the task's name and ID are in the body
            try:
                payload = message.decode()
            except Exception:  # noqa: BLE001 - Celery's handler answers what does not decode
                return False
            if isinstance(payload, Mapping):
                task, request_id = payload.get("task"), payload.get("id")
        if not isinstance(task, str):
            return False  # Celery's handler answers a message that names no task
        routing_key = str((message.delivery_info or {}).get("routing_key") or "")
        who = str(request_id or "?")
        if policy.needs_model(task, routing_key):
            try:
                body = message.decode() if payload is None else payload
            except Exception as exc:  # noqa: BLE001 - answered as Celery answers it, refused unrun
                self.on_decode_error(message, exc)
                return True
            error = policy.refusal(who, task, routing_key, lambda: _named_model(task, body))
        else:
            error = policy.refusal(who, task, routing_key)
        if error is None:
            return False
        self._answer_refused(message, request_id, error)
        return True

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        self._refuse(message, exc)
        super().on_decode_error(message, exc)

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self._refuse(message, exc)
        super().on_invalid_task(body, message, exc)


def _for_the_pipeline(message: Any) -> bool:
    """Whether ``message`` is the pipeline's: any message of an ``infer.*`` queue (the pipeline
    refuses any task there but ``asyncinfer.infer``), and ``asyncinfer.infer`` from any queue."""
    info = message.delivery_info or {}
    if model_from_queue(str(info.get("routing_key") or "")) is not None:
        return True
    headers = message.headers
    return isinstance(headers, Mapping) and headers.get("task") == TASK_NAME


def _named_model(task: str, body: Any) -> str | None:
    """The model a stage task's message names, read as the task reads it (its keyword arguments,
    or the one positional v2 payload of a chain): ``model`` of a request, ``model_name`` of a
    response."""
    if isinstance(body, Mapping):  # protocol 1
        args, kwargs = body.get("args") or (), body.get("kwargs") or {}
    elif isinstance(body, (list, tuple)) and len(body) >= 2:
        args, kwargs = body[0] or (), body[1] or {}
    else:
        return None
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, Mapping):
        return None
    if args:
        one = len(args) == 1 and isinstance(args[0], Mapping) and not kwargs
        request = args[0] if one else {}
    else:
        request = kwargs
    model = request.get("model" if task == PREPROCESS_TASK else "model_name")
    return model if isinstance(model, str) else None
