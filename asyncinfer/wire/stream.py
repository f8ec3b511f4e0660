"""A streaming request's parts on the wire: one Redis Stream per request.

A decoupled model (``Model.decoupled``: it answers in steps, :meth:`Model.stream`) has each step's
outputs for a request appended to the stream ``asyncinfer:stream:<request id>`` on the result
backend's Redis, where a late or reconnecting reader still finds them from the start. The
request's final state is stored as every request's is (Celery's result key), so
``AsyncResult(id)`` and non-streaming clients get one answer: the parts joined
(:meth:`Model.join_parts`).

Entry IDs are the part numbers, so that a part is never shown twice:

- part ``n`` (1-based) has the ID ``n-0``; the worker appends it only when the stream's last ID
  is below ``n-0`` (the append script, worker/output/stream_write.py), so a request that runs
  again after its worker died skips the parts already there and goes on from the first new one;
- a marker after part ``n`` (``start``, ``final``) has the ID ``n-k``, ``k`` ≥ 1: one more than
  the last entry's sequence (before any part, ``0-1``, ``0-2``, ...);
- a reader reads strictly after the last ID it saw (``XREAD ... STREAMS key <last id>``), so it
  sees each entry once however often it reconnects; nothing is appended after a ``final``.

Entry kinds (the ``kind`` field):

``start``
    A worker started (or started again) the request: ``worker`` (its name), ``tag`` (the
    message's delivery tag: its lease is ``ZSCORE asyncinfer:leases <tag>``; empty on a transport
    without leases), ``attempt`` (1 for the first run). A ``start`` after another ``start`` means
    the run before it ended without a ``final``: its worker died (or lost its lease).
``part``
    One step's outputs for the request: ``data``, JSON ``{"outputs": [v2 output tensors]}``
    (JSON data, not binary; each output's first dimension is the request's one row).
``final``
    The request ended: ``status`` (``SUCCESS``, ``FAILURE`` or ``REVOKED``), ``error`` (the
    error's text; empty on success), ``parts`` (how many parts the stream holds).

The stream expires with the request's result (``result_expires``, refreshed at each append) and
holds at most ``stream_max_parts`` entries (the model's option): past that the oldest are trimmed,
and a reader that starts after a trimmed part is told which parts it missed
(:class:`~asyncinfer.errors.StreamTruncated`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncinfer.wire.keys import STREAM_PREFIX

__all__ = [
    "START",
    "PART",
    "FINAL",
    "KINDS",
    "StreamEntry",
    "stream_key",
    "part_id",
    "parse_id",
    "encode_part",
    "decode_entry",
]

START = "start"
PART = "part"
FINAL = "final"
KINDS = (START, PART, FINAL)


def stream_key(request_id: str) -> str:
    """The Redis Stream of ``request_id``'s parts."""
    return STREAM_PREFIX + request_id


def part_id(n: int) -> str:
    """The entry ID of part ``n`` (1-based)."""
    if n < 1:
        raise ValueError(f"part numbers start at 1, not {n}")
    return f"{n}-0"


def parse_id(entry_id: str | bytes) -> tuple[int, int]:
    """``(part, seq)`` of an entry ID: ``(n, 0)`` for part ``n``, ``(n, k)`` for the ``k``-th
    marker after it."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def encode_part(outputs: list[dict[str, Any]]) -> str:
    """The ``data`` field of a part: its v2 output tensors (JSON data)."""
    return json.dumps({"outputs": outputs}, separators=(",", ":"))


@dataclass(frozen=True)
class StreamEntry:
    """One entry of a request's stream, as a reader sees it."""

    id: str
    kind: str
    #: The part number this entry is or follows (0 before the first part).
    part: int
    #: ``part``: its v2 output tensors; else empty.
    outputs: list[dict[str, Any]] = field(default_factory=list)
    #: ``start``: ``worker``, ``tag``, ``attempt``; ``final``: ``status``, ``error``, ``parts``.
    fields: Mapping[str, str] = field(default_factory=dict)

    @property
    def status(self) -> str:
        """A ``final``'s status ('' for other kinds)."""
        return self.fields.get("status", "") if self.kind == FINAL else ""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_entry(entry_id: str | bytes, raw: Mapping[Any, Any]) -> StreamEntry:
    """The entry ``entry_id`` with fields ``raw`` (as redis-py returns them, bytes or str);
    ValueError for an entry that breaks the rules above (a reader reports it, naming the
    request)."""
    fields = {_text(k): _text(v) for k, v in raw.items()}
    kind = fields.get("kind", "")
    if kind not in KINDS:
        raise ValueError(f"stream entry {_text(entry_id)}: unknown kind {kind!r} "
                         f"(known: {', '.join(KINDS)})")
    part, _ = parse_id(entry_id)
    outputs: list[dict[str, Any]] = []
    if kind == PART:
        data = json.loads(fields.pop("data", "") or "{}")
        found = data.get("outputs") if isinstance(data, dict) else None
        if not isinstance(found, list):
            raise ValueError(f"stream entry {_text(entry_id)}: a part's data must be "
                             f'{{"outputs": [...]}}')
        outputs = found
    fields.pop("kind", None)
    return StreamEntry(_text(entry_id), kind, part, outputs, fields)
