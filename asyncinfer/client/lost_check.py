"""Noticing a request the broker lost, without touching the hot path.

A Redis broker can forget a request it accepted: with ``appendfsync everysec`` a host crash drops
the last second of writes, and a failover without ``ASYNCINFER_SUBMIT_REPLICAS`` can lose the
same way. Nothing then answers the request, and a future waiting on it would wait forever (as
Celery's ``AsyncResult`` shows PENDING forever for an ID it does not know).

What tells: the client's publish script writes the request's *trace*, its claim key
``asyncinfer:request:<id>`` (keys.py), in the same script as the push (publisher.py). Redis keeps
a script's writes together (its append-only file and its replicas get them as one MULTI), so after
a restart or a failover the trace is there exactly when the message survived. The trace is never
deleted and lives as long as a result (``result_expires_s``), so a request that is queued (behind
any backlog), taken, leased, running (any kernel), retried or finished keeps it. "No trace and no
result" therefore means "lost": nothing scans a queue or kombu's unacknowledged hash, and what a
check costs does not grow with the backlog.

The rules:

- Only requests whose trace was seen are judged: those this client published (the script wrote
  it), and those a look-up found it for (``Client.future(id)`` of a request another asyncinfer
  client sent). A request with no trace at the first look (sent by Celery's ``send_task`` or
  ``redis-cli``, which write none) is left alone: it waits as before.
- One look every ``lost_after_s / 2``: one MGET of the traces of every waiting request (in chunks),
  then, for the few with none, one EXISTS of their result keys.
- Lost after two looks in a row found neither, so the future ends within about ``lost_after_s`` of
  the loss (plus the time the client takes to reach Redis again), and a worker that held the
  request in memory when Redis lost it gets half a period more to store its answer.
- A look that fails (Redis restarting, loading its file, unreachable) counts for nothing.
- A request waited on for longer than its trace lives (a day by default) is no longer judged: its
  trace may simply have expired.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from asyncinfer.errors import RequestLost
from asyncinfer.wire.keys import CLAIM_PREFIX, TRACES_KEY

__all__ = ["LostCheck", "lost_error", "trace_ttl_s"]

log = logging.getLogger(__name__)

#: Looks in a row that must find neither trace nor result before a request counts as lost.
LOOKS_TO_LOSE = 2


def lost_error(request_id: str) -> RequestLost:
    """The error a lost request's future ends with: what happened and what to do."""
    return RequestLost(
        f"request {request_id}: the broker no longer has this request (no result is stored and "
        f"the trace written with its push is gone: Redis restarted without its last writes, or "
        f"a failover lost them); it will not be answered. Send it again with the same "
        f"request_id ({request_id!r}): if a result was stored meanwhile, that send returns it "
        f"instead of running it again")


def trace_ttl_s(lost_after_s: float, result_expires_s: float) -> float:
    """How long a request's trace lives: as long as its result (a day where results never
    expire); 0 (none written) when the lost check is off."""
    if not lost_after_s > 0:
        return 0.0
    return result_expires_s or 86400.0


@dataclass
class _Trace:
    """What the check knows of one waiting request."""

    since_s: float
    #: Its trace was written by this client or seen by a look: it may be judged.
    seen: bool
    #: Looks in a row that found neither its trace nor its result.
    missing: int = 0


class LostCheck:
    """Judges the requests it is given to trace; :meth:`look` returns those the broker lost.

    Args:
        broker: the Redis client of the broker (where traces are).
        results: the Redis client of the result backend (where results are).
        result_key: the result key of a request ID.
        lost_after_s: the bound (``ASYNCINFER_LOST_AFTER_S``); looks come every half of it.
        trace_ttl_s: how long a trace lives (the publisher's TTL for it).
        clock: monotonic seconds (tests pass their own).
    """

    #: Keys in one MGET.
    chunk = 1000

    def __init__(self, broker: Any, results: Any, result_key: Callable[[str], str], *,
                 lost_after_s: float, trace_ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if lost_after_s <= 0:
            raise ValueError(f"lost_after_s must be > 0, got {lost_after_s!r}")
        self.broker, self.results, self.result_key = broker, results, result_key
        self.period_s = lost_after_s / LOOKS_TO_LOSE
        self.trace_ttl_s = trace_ttl_s
        self.clock = clock
        self._traces: dict[str, _Trace] = {}
        self._lock = threading.Lock()
        self._next_s = clock() + self.period_s
        #: Counts for whoever measures the check's cost: looks made, trace keys read, and the
        #: thread CPU seconds the looks took in this process.
        self.looks = 0
        self.keys_read = 0
        self.cpu_s = 0.0

    @classmethod
    def of(cls, broker: Any, backend: Any, *, lost_after_s: float,
           result_expires_s: float) -> LostCheck | None:
        """The check of a client whose Redis ``broker`` (None: not Redis) holds the traces and
        whose Celery result ``backend`` (Redis) the results; None when the check is off."""
        if broker is None or not lost_after_s > 0:
            return None
        return cls(broker, backend.client,
                   lambda request_id: _text(backend.get_key_for_task(request_id)),
                   lost_after_s=lost_after_s,
                   trace_ttl_s=trace_ttl_s(lost_after_s, result_expires_s))

    def trace(self, request_id: str, *, seen: bool = True) -> None:
        """Judge ``request_id`` from now on; ``seen``: its trace is known to exist (this client's
        publish wrote it). Tracing a request again changes nothing."""
        with self._lock:
            if request_id not in self._traces:
                self._traces[request_id] = _Trace(self.clock(), seen)

    def forget(self, request_id: str) -> None:
        """Stop judging ``request_id`` (answered, cancelled, no longer waited on)."""
        with self._lock:
            self._traces.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._traces)

    def judges(self, request_id: str) -> bool:
        """Whether ``request_id`` is judged: traced, and its trace known to exist."""
        with self._lock:
            state = self._traces.get(request_id)
            return state is not None and state.seen

    def due_in_s(self) -> float:
        """Seconds until the next look is due."""
        return max(0.0, self._next_s - self.clock())

    def look(self) -> list[str]:
        """When a look is due, read every traced request's trace (and the result of those
        without one); return the requests found lost, which are no longer traced."""
        now = self.clock()
        if now < self._next_s:
            return []
        self._next_s = now + self.period_s
        started_s = time.thread_time()
        try:
            return self._look(now)
        finally:
            self.cpu_s += time.thread_time() - started_s

    def _look(self, now: float) -> list[str]:
        with self._lock:
            ids = list(self._traces)
        self.looks += 1
        lost: list[str] = []
        for start in range(0, len(ids), self.chunk):
            chunk = ids[start:start + self.chunk]
            try:
                # a caller-chosen ID's claim is its trace; a generated ID's, a field (keys.py)
                pipe = self.broker.pipeline(transaction=False)
                pipe.mget([CLAIM_PREFIX + i for i in chunk])
                pipe.hmget(TRACES_KEY, chunk)
                claims, fields = pipe.execute()
                traces = [c if c is not None else f for c, f in zip(claims, fields, strict=True)]
                untraced = [i for i, trace in zip(chunk, traces, strict=True) if trace is None]
                stored = self._stored(untraced)
            except (redis.RedisError, OSError) as exc:
                # Restarting, loading, unreachable: this look says nothing about any request.
                log.debug("lost check: no look (%s: %s)", type(exc).__name__, exc)
                return lost
            self.keys_read += len(chunk)
            lost += self._judge(now, chunk, traces, dict(zip(untraced, stored, strict=True)))
        return lost

    def _stored(self, request_ids: list[str]) -> list[bool]:
        """Whether each request has a result stored (one pipelined EXISTS each)."""
        if not request_ids:
            return []
        pipe = self.results.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.exists(self.result_key(request_id))
        return [bool(n) for n in pipe.execute()]

    def _judge(self, now: float, ids: list[str], traces: list[Any],
               stored: dict[str, bool]) -> list[str]:
        lost = []
        with self._lock:
            for request_id, trace in zip(ids, traces, strict=True):
                state = self._traces.get(request_id)
                if state is None:
                    continue  # answered or forgotten while the look ran
                if trace is not None or stored.get(request_id):
                    state.seen, state.missing = True, 0  # there, or finished: not lost
                elif not state.seen:
                    del self._traces[request_id]  # never had a trace: not ours to judge
                elif now - state.since_s >= self.trace_ttl_s - self.period_s:
                    del self._traces[request_id]  # its trace may simply have expired
                else:
                    state.missing += 1
                    if state.missing >= LOOKS_TO_LOSE:
                        del self._traces[request_id]
                        lost.append(request_id)
        return lost


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
