"""Appending to the streams of decoupled models' requests (wire/stream.py), one script call per
result writer batch.

The result writer's thread writes them, never the device thread: the pipeline queues a request's
``start`` when it hands the request to a decoupled model, the device thread queues each part as
it is made (encoded there: a step's outputs are small), and the writer adds the ``final`` of
each outcome it stores. A writer batch appends its entries, in the order they were queued, before
it stores its results, so a request's parts and its ``final`` are in its stream before its result
is stored.

The append script keeps the contract whatever comes twice: part ``n`` is appended (ID ``n-0``)
only when the stream's last ID is below it, so a request run again after its worker died (or
after its batch raised and it ran alone) skips the parts already there; ``start`` and ``final``
get ``<last part>-<last seq + 1>`` (``0-1`` on an empty stream); nothing is appended after a
``final``, so a second ``final`` is dropped. A call tried again after Redis failed to answer (it
may have run) skips a ``start`` that is already the stream's latest ``start`` among the entries
the call could have appended (the same worker, tag and attempt), so that a lost reply does not
read as an interrupted run. Each append trims the stream to its
model's ``stream_max_parts`` (exact ``MAXLEN``) and sets its expiry to the results' (none when
results never expire). Plain ``XADD`` with explicit IDs, ``XREVRANGE``, ``EXPIRE``: Redis 5, 6
and 7. A key that is not a stream, or one whose top entry was deleted by hand (an ID below the
stream's last one is refused), is reported and skipped, the rest written; Redis out of memory
or read-only refuses the whole call, which the writer tries again.

``attempt`` of a ``start``: 1 + the message's Celery ``retries`` + the worker deaths counted
against it on a device (leases; 0 on a transport without them), or + 1 for a message redelivered
without a death counted (its worker died before its device ran it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from celery import states

from asyncinfer.broker.keyspace import keyspace
from asyncinfer.broker.scripts import script
from asyncinfer.broker.store import as_out_of_memory, error_texts
from asyncinfer.wire.protocol import Tensor, encode_tensor
from asyncinfer.wire.stream import FINAL, PART, START, encode_part, stream_key
from asyncinfer.worker.requests.taken import TakenMessage

__all__ = ["StreamAppend", "StreamScript", "start_entry", "part_entry", "final_entry", "attempt_of",
           "lease_tag"]

_APPEND = script("stream_append")


@dataclass(frozen=True)
class StreamAppend:
    """One entry to append to a request's stream (see scripts/stream_append.lua for ``values``)."""

    key: str
    kind: str
    part: int
    max_parts: int
    values: tuple[str, str, str]


def attempt_of(d: TakenMessage) -> int:
    """The ``attempt`` of ``d``'s ``start`` (see the module's text)."""
    retries = d.headers.get("retries")
    again = d.deaths or (1 if d.headers.get("redelivered") else 0)
    return 1 + (retries if isinstance(retries, int) and retries > 0 else 0) + again


def lease_tag(d: TakenMessage) -> str:
    """The tag ``d``'s lease goes by (``ZSCORE asyncinfer:leases <tag>``): its delivery tag when
    its transport leases it (the take script; kombu's Redis channel with leases: Celery's
    consumer on a Redis broker), else '' (RabbitMQ, leases off)."""
    if d.message is None:
        return d.tag or ""
    channel = getattr(d.message, "channel", None)
    return d.tag or "" if getattr(channel, "lease_s", 0) else ""


def start_entry(d: TakenMessage, worker: str) -> StreamAppend:
    """The ``start`` of ``d`` (a decoupled model's request) on ``worker``."""
    tag = lease_tag(d)
    return StreamAppend(stream_key(d.request_id), START, 0, d.stream_max_parts,
                        (worker, tag, str(attempt_of(d))))


def part_entry(d: TakenMessage, index: int, outputs: Sequence[Tensor]) -> StreamAppend:
    """Part ``index`` of ``d``: its v2 output tensors, JSON data (BYTES elements as text)."""
    tensors = [_text_bytes(encode_tensor(t, False)) for t in outputs]
    return StreamAppend(stream_key(d.request_id), PART, index, d.stream_max_parts,
                        (encode_part(tensors), "", ""))


def final_entry(d: TakenMessage, state: str, result: Any) -> StreamAppend | None:
    """The ``final`` of ``d`` ending in ``state`` with ``result`` (an exception's text is its
    ``error``); None when it has no stream or does not end here (a retry, an acknowledgement)."""
    if not d.stream_max_parts or state not in states.READY_STATES:
        return None
    error = str(result) if isinstance(result, BaseException) else ""
    return StreamAppend(stream_key(d.request_id), FINAL, 0, d.stream_max_parts,
                        (state, error, ""))


def _text_bytes(tensor: dict[str, Any]) -> dict[str, Any]:
    if tensor["datatype"] == "BYTES":
        tensor["data"] = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v
                          for v in tensor["data"]]
    return tensor


class StreamScript:
    """The append script, registered on one Redis client; ``expires_s``: how long a stream
    lives after its last append (0: no expiry)."""

    def __init__(self, client: redis.Redis, expires_s: int) -> None:
        self._script = client.register_script(_APPEND)
        self.expires_s = expires_s
        #: The streams' keys go in ARGV: named as Redis holds them (keyspace.py).
        self._space = keyspace(client)

    def __call__(self, appends: Sequence[StreamAppend], client: Any = None, *,
                 again: bool = False) -> tuple[int, list[str]]:
        """Append ``appends`` in order on ``client`` (default: the client it was registered on):
        how many were appended, and the errors of keys that are no streams. ``again``: a call
        tried again after Redis failed to answer (it may have run)."""
        args: list[Any] = [self.expires_s, len(appends) + 1 if again else 0]
        for e in appends:
            args += [self._space.key(e.key), e.kind, e.part, e.max_parts, *e.values]
        try:
            reply = self._script(keys=[], args=args, client=client)
        except redis.ResponseError as exc:
            raise as_out_of_memory(exc) from None
        return int(reply[0]), error_texts(reply[1])
