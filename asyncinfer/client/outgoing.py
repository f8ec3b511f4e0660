"""One request on its way out: what the caller asked for, checked, before it is published.

Built once by the client (:meth:`~asyncinfer.client.client.Client.send`), then published by the
blocking path (a thread: ``Client._send``) or by the event loop's own (``aio.send_on_loop``), so
both send exactly the same message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncinfer.constants import TASK_NAME, model_from_queue, queue_for
from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.envelope import check_request_id, printable
from asyncinfer.wire.messages import task_message
from asyncinfer.wire.payloads import to_input_payload
from asyncinfer.wire.reply import REPLY_TO
from asyncinfer.wire.request_identity import identity
from asyncinfer.wire.sequence import SequenceFlags, sequence_of

__all__ = ["Outgoing", "input_payloads"]


def input_payloads(inputs: Any, binary: bool) -> list[dict[str, Any]]:
    """The v2 inputs of what :meth:`Client.submit` takes: a mapping name → value, v2 input dicts
    as they are, or one value (named ``input``)."""
    if isinstance(inputs, Mapping):
        return [to_input_payload(str(name), value, binary=binary) for name, value in inputs.items()]
    if isinstance(inputs, list) and inputs and all(
            isinstance(i, Mapping) and {"name", "datatype", "shape", "data"} <= i.keys()
            for i in inputs):
        return [dict(i) for i in inputs]  # already v2 input dicts
    return [to_input_payload("input", inputs, binary=binary)]


@dataclass
class Outgoing:
    """A task message to send: its task, queue, keyword arguments and Celery options."""

    task: str
    queue: str
    kwargs: dict[str, Any]
    request_id: str
    #: Claim the request ID (a caller-chosen one): a second send of it publishes nothing.
    claim: bool
    serializer: str
    link: Any = None
    link_error: Any = None
    expires: float | None = None
    #: How long to wait for room in a bounded queue (None: the client's setting).
    timeout_s: float | None = None
    soft_time_limit_s: float | None = None
    time_limit_s: float | None = None
    priority: int = 0
    #: The model the request is for (``asyncinfer.infer`` on ``infer.<model>``): given by
    #: :meth:`infer`, else read once from the queue's name; None on a queue of no model.
    model: str | None = None
    #: The W3C trace context the message carries (``traceparent``, ``tracestate``: its parent
    #: span, wire/trace_context.py); None: none. With tracing on, the sender replaces it with
    #: its submit span's (asyncinfer/tracing).
    trace: dict[str, str] | None = None
    #: The sequence an ``asyncinfer.infer`` request belongs to (its v2 parameters
    #: ``sequence_id``, ``sequence_start``, ``sequence_end``; wire/sequence.py), routed to the
    #: sequence's worker by the publish script (publisher.py); None: none.
    sequence: SequenceFlags | None = field(default=None, init=False)

    @classmethod
    def infer(cls, model: str, inputs: Any, request_id: str, claim: bool, serializer: str, *,
              binary: bool, parameters: Mapping[str, Any] | None = None,
              **options: Any) -> Outgoing:
        """An ``asyncinfer.infer`` request for ``model`` on its queue ``infer.<model>``."""
        payload = {"model": model, "inputs": input_payloads(inputs, binary),
                   "parameters": dict(parameters or {})}
        options["priority"] = options.get("priority") or 0
        return cls(TASK_NAME, queue_for(model), payload, request_id, claim, serializer,
                   model=model, **options)

    def __post_init__(self) -> None:
        if type(self.priority) is not int or not 0 <= self.priority <= 9:
            raise InvalidRequest(f"request {printable(self.request_id)}: priority must be an "
                                 f"integer 0 to 9, got {self.priority!r}")
        check_request_id(self.request_id)
        if self.model is None:
            self.model = model_from_queue(self.queue)
        if self.task == TASK_NAME:
            self.sequence = sequence_of(self.kwargs.get("parameters"),
                                        f"request {printable(self.request_id)}")

    def identity(self) -> str:
        """What this request's ID stands for, when its caller chose the ID (the claim's value:
        wire/request_identity.py); "" for a generated ID (it claims nothing)."""
        return identity(self.queue, self.kwargs) if self.claim else ""

    def message(self, reply_to: str, max_body_bytes: int | None) -> str:
        """The kombu envelope to LPUSH on a Redis broker, naming ``reply_to`` as its reply
        channel (InvalidRequest when its body is over ``max_body_bytes``)."""
        embed = {"callbacks": [dict(self.link)] if self.link is not None else None,
                 "errbacks": [dict(self.link_error)] if self.link_error is not None else None}
        return task_message(self.task, self.request_id, self.kwargs, self.queue,
                            serializer=self.serializer, embed=embed, expires_s=self.expires,
                            kwargsrepr=f"{{'model': {self.kwargs.get('model')!r}, ...}}",
                            max_body_bytes=max_body_bytes, time_limit_s=self.time_limit_s,
                            soft_time_limit_s=self.soft_time_limit_s, priority=self.priority,
                            reply_to=reply_to, trace=self.trace)

    def send_task_options(self, reply_to: str) -> dict[str, Any]:
        """Celery's ``send_task`` arguments for the same request (brokers other than Redis)."""
        return {"kwargs": self.kwargs, "task_id": self.request_id, "queue": self.queue,
                "serializer": self.serializer, "link": self.link, "link_error": self.link_error,
                "expires": self.expires, "time_limit": self.time_limit_s,
                "soft_time_limit": self.soft_time_limit_s, "priority": self.priority,
                "headers": {REPLY_TO: reply_to, **(self.trace or {})}}
