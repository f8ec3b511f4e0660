"""One request on its way out: what the caller asked for, checked, before it is published.

Built once by the client (:meth:`~asyncinfer.client.client.Client.send`), then published by the
blocking path (a thread: ``Client._send``) or by the event loop's own (``aio.send_on_loop``), so
both send exactly the same message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncinfer.constants import TASK_NAME, model_from_queue, queue_for
from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.datatypes import SPECS
from asyncinfer.wire.envelope import check_request_id, payload_too_large, printable
from asyncinfer.wire.messages import task_message
from asyncinfer.wire.payloads import array_from_value, encode_payload
from asyncinfer.wire.reply import REPLY_TO
from asyncinfer.wire.request_identity import identity
from asyncinfer.wire.sequence import SequenceFlags, sequence_of
from asyncinfer.wire.tensor_refs import DATA_REF

__all__ = ["Outgoing", "input_payloads", "least_body_bytes"]


def input_payloads(inputs: Any, binary: bool, *, serializer: str = "json",
                   max_body_bytes: int | None = None, request_id: str = "") -> list[dict[str, Any]]:
    """The v2 inputs of what :meth:`Client.submit` takes: a mapping name → value, v2 input dicts
    as they are, or one value (named ``input``).

    With ``max_body_bytes``, values whose message body (``serializer``'s) must be longer are
    refused before they are encoded (:func:`least_body_bytes`): encoding 200 MB takes seconds,
    only for :func:`~asyncinfer.wire.messages.task_message` to refuse the result."""
    def refuse_over(least: int) -> None:
        if max_body_bytes and least > max_body_bytes:
            raise payload_too_large(printable(request_id), least, max_body_bytes, at_least=True)

    if isinstance(inputs, list) and inputs and all(
            isinstance(i, Mapping) and {"name", "datatype", "shape"} <= i.keys()
            and ("data" in i or DATA_REF in (i.get("parameters") or {}))
            for i in inputs):  # already v2 input dicts (or references): only raw data is counted
        refuse_over(_base64_bytes(sum(len(i["data"]) for i in inputs
                                      if isinstance(i.get("data"), (bytes, bytearray)))))
        return [dict(i) for i in inputs]
    named = inputs.items() if isinstance(inputs, Mapping) else [("input", inputs)]
    arrays = [(str(name), *array_from_value(str(name), value)) for name, value in named]
    if max_body_bytes:
        refuse_over(least_body_bytes([(datatype, value) for _, datatype, _, value in arrays],
                                     binary, serializer))
    return [encode_payload(name, datatype, shape, value, binary)
            for name, datatype, shape, value in arrays]


#: Least bytes one element's ``data`` takes in a body, when data is a list: JSON text ("0,", a
#: float never shorter than "0.0,", "true,") and msgpack (a fixint or bool: 1; a Python float is
#: packed as a float64: 9).
_LEAST_LIST_ITEM_BYTES = {"json": {"int": 2, "float": 4, "bool": 5},
                          "msgpack": {"int": 1, "float": 9, "bool": 1}}


def least_body_bytes(values: Sequence[tuple[str, Any]], binary: bool, serializer: str) -> int:
    """The fewest bytes the base64 body of a request of these ``(datatype, values)`` can take:
    its data alone (raw bytes: the wire itemsize per element; a list: the least text or msgpack
    of each element; BYTES: each element's length), which base64 makes 4/3 as long. The
    envelope around it only adds, so a request whose estimate is over a limit is over it."""
    data_bytes = 0
    for datatype, value in values:
        spec = SPECS[datatype]
        if spec.kind == "bytes":
            data_bytes += sum(len(x) for x in np.asarray(value, dtype=object).reshape(-1).tolist()
                              if isinstance(x, (str, bytes)))
        else:
            per_item = spec.itemsize if binary else _LEAST_LIST_ITEM_BYTES[serializer][spec.kind]
            data_bytes += int(np.size(value)) * per_item
    return _base64_bytes(data_bytes)


def _base64_bytes(size_bytes: int) -> int:
    """The length of ``size_bytes`` bytes in base64: 4 characters per 3 bytes, the last 3 padded."""
    return 4 * -(-size_bytes // 3)


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
              max_body_bytes: int | None = None, **options: Any) -> Outgoing:
        """An ``asyncinfer.infer`` request for ``model`` on its queue ``infer.<model>``
        (InvalidRequest, before its inputs are encoded, when they show its body must be over
        ``max_body_bytes``)."""
        payload = {"model": model, "inputs": input_payloads(
                       inputs, binary, serializer=serializer, max_body_bytes=max_body_bytes,
                       request_id=request_id),
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
