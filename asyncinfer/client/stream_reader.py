"""Reading one request's stream of parts (wire/stream.py) as it is written: blocking and asyncio.

A reader sends ``XREAD BLOCK`` strictly after the last entry ID it saw (``0-0``, or part ``n`` to
resume after it), so it shows each part once however often it reconnects. It ends after the
stream's ``final``: nothing more (SUCCESS), or the request's error as its future raises it
(FAILURE: the stored result's exception; REVOKED: :class:`~asyncinfer.errors.RequestRevoked`
naming the request). A part above the next one expected (the stream was trimmed to the model's
``stream_max_parts``) raises :class:`~asyncinfer.errors.StreamTruncated`; an entry that breaks the
contract raises :class:`StreamMalformed`; both name the request.

Between entries, every ``check_s``, it looks at two things in one round trip:

- the lease of the last ``start`` (``ZSCORE asyncinfer:leases <tag>`` against Redis' ``TIME``):
  gone or run out with no ``final`` means its worker died or froze. That is reported once per
  ``start`` (:class:`Interruption`: a list and a callback) and the reader goes on waiting: the
  request is delivered again, a new ``start`` follows and its parts go on after the last one seen.
  A second ``start`` with no interruption reported for the first is one too;
- the request's stored result (Celery's result key): stored with no ``final`` in the stream (a
  model that does not stream, a request refused before its model ran) ends the reading with that
  result as one part, or its error.

:class:`StreamProgress` is the sans-IO core (what an entry or a look means); :class:`StreamReader`
and :class:`AsyncStreamReader` only do the I/O, on redis-py and ``redis.asyncio`` clients of the
result backend.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from celery import states
from celery.exceptions import TaskRevokedError

from asyncinfer.backoff import Backoff
from asyncinfer.client.responses import InferResponse, StreamPart
from asyncinfer.errors import (
    AsyncInferError,
    BrokerUnavailable,
    RequestExpired,
    RequestRevoked,
    RequestTimeout,
    StreamTruncated,
)
from asyncinfer.keys import LEASES_KEY
from asyncinfer.wire.stream import FINAL, PART, START, StreamEntry, decode_entry, parse_id, stream_key

__all__ = ["Interruption", "StreamMalformed", "StreamProgress", "StreamReader",
           "AsyncStreamReader", "Stored", "FINAL_STATES"]

log = logging.getLogger(__name__)

#: A stored result payload → ``(status, outcome)``: for a final status the response or the
#: exception its future would give (:func:`~asyncinfer.client.responses.stored_outcome`), else None.
Stored = Callable[[Any], tuple[str, Any]]

#: The statuses a ``final`` may hold.
FINAL_STATES = (states.SUCCESS, states.FAILURE, states.REVOKED)

#: Entries read in one XREAD at most.
READ_COUNT = 256
#: The longest one XREAD blocks (seconds), whatever ``check_s`` says.
MAX_BLOCK_S = 10.0


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
        if self.last_part > 0 or not isinstance(outcome, InferResponse):
            return []
        return [StreamPart(self.request_id, self.last_part + 1, list(outcome.outputs.values()))]

    def as_error(self, outcome: Any) -> BaseException:
        """A stored error as a stream raises it: Celery's TaskRevokedError as RequestRevoked."""
        if isinstance(outcome, TaskRevokedError):
            error = revoked_error(self.request_id, str(outcome))
            error.__cause__ = outcome
            return error
        if isinstance(outcome, BaseException):
            return outcome
        return AsyncInferError(f"request {self.request_id}: ended with {outcome!r}")


def revoked_error(request_id: str, reason: str) -> RequestRevoked:
    """RequestRevoked (RequestExpired for an expired one) naming ``request_id``."""
    reason = reason.strip() or "revoked"
    kind = RequestExpired if reason.startswith("expired") else RequestRevoked
    return kind(f"request {request_id}: {reason}" if reason.startswith(("revoked", "expired"))
                else f"request {request_id}: revoked ({reason})")


def _count(reply: Any) -> int:
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


def _waits(check_s: float) -> float:
    if check_s <= 0:
        raise ValueError(f"check_s must be above 0, got {check_s!r}")
    return min(check_s, MAX_BLOCK_S)


class _Reading:
    """What both readers share: the progress, the settings, the clock."""

    #: How long a FAILURE's stored result may take to follow its ``final`` (seconds).
    failure_wait_s = 5.0
    #: How long Redis may fail every read before the reader gives up (seconds).
    give_up_after_s = 30.0

    def __init__(self, client: Any, request_id: str, *, result_key: str, stored: Stored,
                 after: int = 0, check_s: float = 1.0,
                 on_interrupted: Callable[[Interruption], Any] | None = None,
                 timeout_s: float | None = None,
                 lost: Callable[[], BaseException | None] | None = None) -> None:
        self.client = client
        self.progress = StreamProgress(request_id, after=after, on_interrupted=on_interrupted)
        self.result_key = result_key
        self.stored = stored
        self.check_s = _waits(check_s)
        self.timeout_s = timeout_s
        self.lost = lost
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._failing_since: float | None = None
        self._backoff = Backoff()

    @property
    def request_id(self) -> str:
        return self.progress.request_id

    @property
    def interruptions(self) -> list[Interruption]:
        """Every interruption reported so far."""
        return self.progress.interruptions

    @property
    def ended(self) -> bool:
        """The request's end was seen (nothing more will come)."""
        return self.progress.ended

    def _block_ms(self) -> int:
        wait_s = self.check_s
        if self._deadline is not None:
            left_s = self._deadline - time.monotonic()
            if left_s <= 0:
                raise RequestTimeout(
                    f"request {self.request_id}: its stream did not end within "
                    f"{self.timeout_s:g} s (last part seen: {self.progress.last_part}); it may "
                    f"still finish (read it on with read_stream('{self.request_id}', "
                    f"after={self.progress.last_part}))")
            wait_s = min(wait_s, left_s)
        return max(1, int(wait_s * 1000))

    def _check_lost(self) -> None:
        if self.lost is not None:
            error = self.lost()
            if error is not None:
                self.progress.ended = True
                raise error

    def _looks(self, pipe: Any) -> None:
        """Queue the looks between entries on ``pipe``: the lease (and TIME), the result."""
        tag = self.progress.lease_tag
        if tag:
            pipe.zscore(LEASES_KEY, tag)
            pipe.time()
        pipe.get(self.result_key)

    def _judge(self, replies: list[Any], reply: Any) -> list[StreamPart]:
        """After the looks (:meth:`_looks`' ``replies``) and one more read of the stream
        (``reply``): the entries read, then the stored result, else the lease. A stored result
        is stored after its ``final``, and a lease given back after both: what the read found
        was in the stream before the looks were made."""
        progress = self.progress
        drained = progress.take_reply(reply)
        if progress.final is not None or progress.failure is not None:
            return drained
        if _count(reply) >= READ_COUNT:
            return drained  # more to read: judged at the next look
        status, outcome = self.stored(replies[-1]) if replies[-1] is not None else ("", None)
        if status in FINAL_STATES:
            return drained + progress.stored_end(status, outcome)
        if len(replies) == 3:
            progress.judge_lease(replies[0], replies[1])
        return drained

    def _failed(self, exc: Exception) -> float:
        """Redis failed a read: seconds to wait before the next, or raise when it has failed
        for too long."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if now - self._failing_since > self.give_up_after_s:
            raise BrokerUnavailable(
                f"request {self.request_id}: the result backend's Redis failed every read of its "
                f"stream for {self.give_up_after_s:g} s ({type(exc).__name__}: {exc}); read it on "
                f"with read_stream('{self.request_id}', after={self.progress.last_part})") from exc
        wait_s = self._backoff.failed()
        log.warning("request %s: reading its stream failed (%s); again in %.1f s",
                    self.request_id, exc, wait_s)
        return wait_s

    def _answered(self) -> None:
        self._failing_since = None
        self._backoff.reset()


class StreamReader(_Reading):
    """Iterate for the parts of one request's stream (a redis-py client of the result backend)."""

    def __iter__(self) -> Iterator[StreamPart]:
        return self._read()

    def _read(self) -> Iterator[StreamPart]:
        progress = self.progress
        next_check = time.monotonic()  # the first look at once: a request long finished
        while True:
            looking = progress.final is None and time.monotonic() >= next_check
            try:
                if looking:
                    next_check = time.monotonic() + self.check_s
                    parts = self._check()
                else:
                    parts = progress.take_reply(self.client.xread(
                        {progress.key: progress.last_id}, count=READ_COUNT,
                        block=self._block_ms()))
                self._answered()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                time.sleep(self._failed(exc))
                continue
            yield from parts
            if progress.failure is not None:
                raise progress.failure
            if progress.final is not None:
                error = progress.final_error(self._stored_failure())
                if error is not None:
                    raise error
                return
            if progress.ended:
                return

    def _check(self) -> list[StreamPart]:
        self._check_lost()
        pipe = self.client.pipeline(transaction=False)
        self._looks(pipe)
        replies = pipe.execute()
        reply = self.client.xread({self.progress.key: self.progress.last_id}, count=READ_COUNT)
        return self._judge(replies, reply)

    def _stored_failure(self) -> tuple[str, Any] | None:
        """A FAILURE's stored result (written just after its ``final``), waited for a while."""
        final = self.progress.final
        if final is None or final.status != states.FAILURE:
            return None
        give_up = time.monotonic() + self.failure_wait_s
        while True:
            try:
                payload = self.client.get(self.result_key)
            except (redis.ConnectionError, redis.TimeoutError):
                payload = None
            if payload is not None:
                stored = self.stored(payload)
                if stored[0] in FINAL_STATES:
                    return stored
            if time.monotonic() >= give_up:
                return None
            time.sleep(0.02)


class AsyncStreamReader(_Reading):
    """``async for`` the parts of one request's stream (a ``redis.asyncio`` client of the result
    backend)."""

    def __aiter__(self) -> AsyncIterator[StreamPart]:
        return self._read()

    async def _read(self) -> AsyncIterator[StreamPart]:
        progress = self.progress
        next_check = time.monotonic()  # the first look at once: a request long finished
        while True:
            looking = progress.final is None and time.monotonic() >= next_check
            try:
                if looking:
                    next_check = time.monotonic() + self.check_s
                    parts = await self._check()
                else:
                    parts = progress.take_reply(await self.client.xread(
                        {progress.key: progress.last_id}, count=READ_COUNT,
                        block=self._block_ms()))
                self._answered()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                await asyncio.sleep(self._failed(exc))
                continue
            for part in parts:
                yield part
            if progress.failure is not None:
                raise progress.failure
            if progress.final is not None:
                error = progress.final_error(await self._stored_failure())
                if error is not None:
                    raise error
                return
            if progress.ended:
                return

    async def _check(self) -> list[StreamPart]:
        self._check_lost()
        pipe = self.client.pipeline(transaction=False)
        self._looks(pipe)
        replies = await pipe.execute()
        reply = await self.client.xread({self.progress.key: self.progress.last_id},
                                        count=READ_COUNT)
        return self._judge(replies, reply)

    async def _stored_failure(self) -> tuple[str, Any] | None:
        final = self.progress.final
        if final is None or final.status != states.FAILURE:
            return None
        give_up = time.monotonic() + self.failure_wait_s
        while True:
            try:
                payload = await self.client.get(self.result_key)
            except (redis.ConnectionError, redis.TimeoutError):
                payload = None
            if payload is not None:
                stored = self.stored(payload)
                if stored[0] in FINAL_STATES:
                    return stored
            if time.monotonic() >= give_up:
                return None
            await asyncio.sleep(0.02)
