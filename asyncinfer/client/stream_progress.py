"""The sans-IO core of a stream reader (client/stream_reader.py): what each entry of a request's
stream (wire/stream.py), and each look between entries, means to a reader.

:class:`StreamProgress` holds what the reader has seen (the last entry ID, the last part, the
last ``start``, the ``final``) and decides: a part to show, a gap (:class:`~asyncinfer.errors.
StreamTruncated`), an entry that breaks the contract (:class:`StreamMalformed`), a run
interrupted (:class:`Interruption`, once per ``start``), the request's end and its error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery import states
from celery.exceptions import TaskRevokedError

from asyncinfer.client.responses import InferResponse, StreamPart, revoked_error
from asyncinfer.errors import AsyncInferError, RequestRevoked, StreamTruncated
from asyncinfer.wire.stream import FINAL, PART, START, StreamEntry, decode_entry, parse_id, stream_key

__all__ = ["FINAL_STATES", "Interruption", "StreamMalformed", "StreamProgress", "entry_count"]

log = logging.getLogger(__name__)

#: The statuses a ``final`` may hold.
FINAL_STATES = (states.SUCCESS, states.FAILURE, states.REVOKED)


class StreamMalformed(AsyncInferError, ValueError):
    """An entry of a request's stream breaks the contract of wire/stream.py."""


@dataclass(frozen=True)
class Interruption:
    """A run of a streaming request that ended without a ``final``: its worker died or froze."""

    request_id: str
    #: The worker the ``start`` named, its delivery tag and attempt (1: the first run).
    worker: str
    tag: str
    attempt: int
    #: The last part the reader had seen when it noticed.
    after_part: int
    #: What gave it away (a lease gone or run out, a new ``start``).
    reason: str


class StreamProgress:
    """What a reader of ``request_id``'s stream has seen, and what each entry or look means."""

    def __init__(self, request_id: str, *, after: int = 0,
                 on_interrupted: Callable[[Interruption], Any] | None = None) -> None:
        if not request_id:
            raise ValueError("a stream reader needs a request ID")
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise ValueError(f"request {request_id}: after must be a part number of at least 0 "
                             f"(0: from the start), got {after!r}")
        self.request_id = request_id
        self.key = stream_key(request_id)
        #: The last entry ID seen: the next read is strictly after it.
        self.last_id = f"{after}-0" if after else "0-0"
        #: The last part number seen (or skipped with ``after``).
        self.last_part = after
        self.interruptions: list[Interruption] = []
        #: The stream's ``final``, once seen.
        self.final: StreamEntry | None = None
        #: The request's end was seen (a ``final``, or its stored result): nothing more comes.
        self.ended = False
        #: The error that ended the reading after the parts before it (a gap, a bad entry).
        self.failure: BaseException | None = None
        self._on_interrupted = on_interrupted
        self._start: StreamEntry | None = None
        self._reported = False

    # -- entries ---------------------------------------------------------------------------------

    def take_reply(self, reply: Any) -> list[StreamPart]:
        """The parts in an XREAD reply (RESP2 list or RESP3 map); stops at a ``final``."""
        if not reply:
            return []
        streams = reply.items() if isinstance(reply, Mapping) else reply
        parts: list[StreamPart] = []
        for _key, entries in streams:
            for entry_id, fields in _entries(entries):
                try:
                    part = self.take(entry_id, fields or {})
                except (StreamTruncated, StreamMalformed) as exc:
                    # the parts before it are shown first; the error ends the reading
                    self.failure, self.ended = exc, True
                    return parts
                if part is not None:
                    parts.append(part)
                if self.final is not None:
                    return parts
        return parts

    def take(self, entry_id: Any, raw: Mapping[Any, Any]) -> StreamPart | None:
        """Take the next entry; its part (None for a marker). Raises StreamTruncated at a gap,
        StreamMalformed for an entry that breaks the contract."""
        try:
            entry = decode_entry(entry_id, raw)
            part, seq = parse_id(entry.id)
        except ValueError as exc:
            raise self._malformed(f"{exc}") from exc
        self.last_id = entry.id
        if entry.kind == PART:
            if seq != 0:
                raise self._malformed(f"part entry {entry.id}: a part's ID is <part>-0")
            self._check_gap(part - 1, part)
            self.last_part = part
            return StreamPart(self.request_id, part, entry.outputs)
        if seq == 0:
            raise self._malformed(f"{entry.kind} entry {entry.id}: a marker's ID is "
                                  f"<last part>-<k>, k at least 1")
        self._check_gap(part, part)
        if entry.kind == START:
            if self._start is not None and not self._reported:
                self._report(f"a new start (worker {entry.fields.get('worker') or '?'}, attempt "
                             f"{entry.fields.get('attempt') or '?'}) with no final before it")
            self._start, self._reported = entry, False
        elif entry.kind == FINAL:
            if entry.status not in FINAL_STATES:
                raise self._malformed(f"final entry {entry.id}: status {entry.status!r} "
                                      f"(known: {', '.join(FINAL_STATES)})")
            self.final = entry
        return None

    def _check_gap(self, last_missing: int, first_held: int) -> None:
        if last_missing <= self.last_part:
            return
        first_missing = self.last_part + 1
        missed = (f"part {first_missing}" if first_missing == last_missing
                  else f"parts {first_missing}-{last_missing}")
        exc = StreamTruncated(
            f"request {self.request_id}: {missed} of its stream were trimmed before this reader "
            f"read them (the model's stream_max_parts); the stream holds part {first_held} on. "
            f"Its final result (client.result('{self.request_id}')) holds every part, joined")
        exc.request_id = self.request_id  # type: ignore[attr-defined]
        exc.missed = range(first_missing, last_missing + 1)  # type: ignore[attr-defined]
        raise exc

    def _malformed(self, what: str) -> StreamMalformed:
        return StreamMalformed(f"request {self.request_id}: its stream {self.key} has an entry "
                               f"that breaks the stream contract (wire/stream.py): {what}")

    # -- looks between entries -----------------------------------------------------------------

    @property
    def lease_tag(self) -> str:
        """The delivery tag whose lease to look at: the last ``start``'s, unless its run was
        already reported interrupted (or it named none)."""
        if self._start is None or self._reported or self.final is not None:
            return ""
        return self._start.fields.get("tag", "")

    def judge_lease(self, score: Any, now: Any) -> None:
        """The lease of :attr:`lease_tag` was ``score`` (None: gone) at Redis time ``now``
        (``TIME``'s reply), and no ``final`` followed: report the run interrupted."""
        if not self.lease_tag or self.final is not None:
            return
        seconds, micros = now
        now_s = float(seconds) + float(micros) / 1e6
        if score is None:
            self._report("its lease is gone with no final: its worker died (or gave it back)")
        elif float(score) < now_s:
            self._report(f"its lease ran out {now_s - float(score):.1f} s ago with no final: its "
                         f"worker died or froze")

    def _report(self, reason: str) -> None:
        start = self._start
        assert start is not None
        self._reported = True
        try:
            attempt = int(start.fields.get("attempt") or 0)
        except ValueError:
            attempt = 0
        interruption = Interruption(self.request_id, start.fields.get("worker", ""),
                                    start.fields.get("tag", ""), attempt, self.last_part, reason)
        self.interruptions.append(interruption)
        # said once: by the caller's hook when it has one
        log.log(logging.DEBUG if self._on_interrupted else logging.WARNING,
                "request %s: its run on worker %s (attempt %s) was interrupted after part %d: %s; "
                "waiting for it to run again", self.request_id, interruption.worker or "?",
                attempt, self.last_part, reason)
        if self._on_interrupted is not None:
            try:
                self._on_interrupted(interruption)
            except Exception:  # noqa: BLE001 - a caller's hook must not end the reading
                log.exception("request %s: on_interrupted raised", self.request_id)

    # -- the end -------------------------------------------------------------------------------

    def final_error(self, stored: tuple[str, Any] | None) -> BaseException | None:
        """The ``final``'s error (None for SUCCESS); ``stored``: the request's stored result,
        whose exception a FAILURE raises (None: not stored yet, the final's text is used)."""
        final = self.final
        assert final is not None
        self.ended = True
        text = final.fields.get("error", "")
        if final.status == states.SUCCESS:
            return None
        if stored is not None and stored[0] in FINAL_STATES and stored[0] != states.SUCCESS:
            return self.as_error(stored[1])
        if final.status == states.REVOKED:
            return revoked_error(self.request_id, text)
        return AsyncInferError(f"request {self.request_id}: failed: {text or 'no error text'}")

    def stored_end(self, status: str, outcome: Any) -> list[StreamPart]:
        """The request's result is stored (``status`` ready) and its stream holds no ``final``:
        the result as one part (SUCCESS, when no part was seen), else its error (raised)."""
        self.ended = True
        if status != states.SUCCESS:
            raise self.as_error(outcome)
        if self.last_part > 0 or not isinstance(outcome, InferResponse) or not outcome.outputs:
            return []  # (no outputs: a decoupled request that ended without a part)
        return [StreamPart(self.request_id, self.last_part + 1, list(outcome.outputs.values()))]

    def as_error(self, outcome: Any) -> BaseException:
        """A stored error as a stream raises it: Celery's TaskRevokedError as RequestRevoked."""
        if isinstance(outcome, RequestRevoked):  # the client's already (client/responses.py)
            return outcome
        if isinstance(outcome, TaskRevokedError):
            error = revoked_error(self.request_id, str(outcome))
            error.__cause__ = outcome
            return error
        if isinstance(outcome, BaseException):
            return outcome
        return AsyncInferError(f"request {self.request_id}: ended with {outcome!r}")


def entry_count(reply: Any) -> int:
    """How many entries an XREAD reply holds."""
    if not reply:
        return 0
    streams = reply.values() if isinstance(reply, Mapping) else [e for _, e in reply]
    return sum(len(_entries(e)) for e in streams)


def _entries(entries: Any) -> Any:
    """A stream's entries in an XREAD reply: ``[(id, fields), ...]`` (RESP3 wraps them once
    more)."""
    if entries and isinstance(entries[0], list) and entries[0] and isinstance(
            entries[0][0], (list, tuple)):
        return entries[0]
    return entries
