"""A worker's result writers: one per Redis its intakes take from (worker/consumers/
shard_intake.py) — one, or one per shard of a cluster that spreads requests. Each request's
outcome, stream entries and STARTED state go to the writer of the shard it was taken from, where
its result, its stream and its bookkeeping live; each writer stores its own in batches on its
own thread (result_writer.py).

Its writers share the callbacks around each write (the retry budget before, the settlement
after): with more than one writer they run under one lock, as they would on the one writer's
thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis

from asyncinfer.worker.lifecycle import answered_before
from asyncinfer.worker.output.outcome import Outcome
from asyncinfer.worker.output.result_writer import ResultWriter
from asyncinfer.worker.requests.taken import TakenMessage

__all__ = ["ShardWriters"]


class ShardWriters:
    """A :class:`ResultWriter` on each of ``clients`` (index: the shard), the rest of the
    arguments as a ResultWriter's."""

    def __init__(self, app: Any, clients: Sequence[redis.Redis], *,
                 on_written: Callable[[list[Outcome]], None], worker: str,
                 before_write: Callable[[list[Outcome]], None], shared: bool | None,
                 spans: Any) -> None:
        if len(clients) > 1:  # the callbacks of several writer threads, one at a time
            lock = threading.Lock()
            before_write, on_written = _locked(before_write, lock), _locked(on_written, lock)
        self.writers = [ResultWriter(app, client, on_written, worker=worker,
                                     before_write=before_write, shared=shared,
                                     spans=spans if shard == 0 else _shared_spans(spans))
                        for shard, client in enumerate(clients)]

    def of(self, shard: int) -> ResultWriter:
        """The writer of ``shard``'s requests."""
        return self.writers[shard]

    @property
    def results(self) -> redis.Redis:
        """Where the results of shard 0 (and of kombu's messages) live."""
        return self.writers[0].results

    def put(self, outcome: Outcome) -> None:
        self.writers[outcome.delivery.shard].put(outcome)

    def stream_start(self, d: TakenMessage, worker: str) -> None:
        self.writers[d.shard].stream_start(d, worker)

    def stream_part(self, d: TakenMessage, index: int, outputs: list[Any]) -> None:
        self.writers[d.shard].stream_part(d, index, outputs)

    @contextlib.contextmanager
    def gathering(self) -> Iterator[None]:
        """Every writer's :meth:`ResultWriter.gathering` at once: what this thread puts meanwhile
        goes to each writer in one hand-over as it leaves."""
        with contextlib.ExitStack() as stack:
            for writer in self.writers:
                stack.enter_context(writer.gathering())
            yield

    def store_started(self, deliveries: list[TakenMessage], hostname: str) -> None:
        """The STARTED states of ``deliveries``, each on its shard."""
        for writer, group in zip(self.writers, by_shard(deliveries, len(self.writers)), strict=True):
            if group:
                writer.store_started(group, hostname)

    def answered_before(self, backend: Any, deliveries: list[TakenMessage]) -> dict[str, str]:
        """Those of ``deliveries`` (redelivered) whose final result is already stored on their
        shard, with its state (lifecycle.py's :func:`answered_before`)."""
        answered: dict[str, str] = {}
        for writer, group in zip(self.writers, by_shard(deliveries, len(self.writers)), strict=True):
            if group:
                answered.update(answered_before(backend, [d.request_id for d in group],
                                                writer.results))
        return answered

    def close(self) -> None:
        """Write what is queued, then stop (each writer; shard 0's, which closes the spans, last)."""
        for writer in reversed(self.writers):
            writer.close()


def by_shard(deliveries: Sequence[TakenMessage], shards: int) -> list[list[TakenMessage]]:
    """``deliveries`` by the shard they were taken from (index: the shard)."""
    groups: list[list[TakenMessage]] = [[] for _ in range(shards)]
    for d in deliveries:
        groups[d.shard].append(d)
    return groups


def _locked(call: Callable[[list[Outcome]], None],
            lock: threading.Lock) -> Callable[[list[Outcome]], None]:
    def locked(batch: list[Outcome]) -> None:
        with lock:
            call(batch)
    return locked


class _SharedSpans:
    """Spans another writer closes: handed over to, never closed here."""

    def __init__(self, spans: Any) -> None:
        self._spans = spans

    def hand_over(self, *args: Any) -> None:
        self._spans.hand_over(*args)

    def close(self) -> None:
        pass


def _shared_spans(spans: Any) -> Any:
    return _SharedSpans(spans) if spans is not None else None
