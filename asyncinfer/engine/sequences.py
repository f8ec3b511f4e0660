"""The sequences of one stateful model on one worker: Triton's sequence batcher, Oldest strategy.

Triton's Oldest strategy routes every request of a sequence to one model instance and batches, with
the dynamic batcher, one request from each of several sequences into one batch. Here the fleet
routes a sequence to one worker (its pin: worker/requests/sequence_pins.py) and this book, in front
of the model's :class:`~asyncinfer.engine.batcher.Batcher`, keeps each sequence's requests in
order and lets only the oldest of each into the batcher, and only once the one before it is
answered: a batch holds at most one request of a sequence, the batcher forms it from the heads of
every sequence waiting (with its usual rules: delay, preferred sizes, priorities), and a
sequence's next request sees the state its previous one left.

The book also keeps what the runtime keeps of each sequence: its implicit state (the model's
:class:`~asyncinfer.models.sequence.SequenceState`: the state output of its last request, zeros
at its START), released when its END is answered or when it was idle ``idle_timeout_s``
(:meth:`SequenceBook.expire`). A request of a sequence the book does not hold — never started
here, ended, released — is refused with Triton's words, never run on a fresh state. A request
that fails leaves its sequence's state as it was.

A request of a sequence can run here after the fleet already failed it with SequenceStateLost
(this worker was frozen or cut off past its lease, and another worker's sweep failed what it held:
worker/requests/sequence_pins.py); its result is then left out (broker/store.py) and
:meth:`SequenceBook.void` takes back the state it left: the sequence's state is again the one
before it, as for any request that fails — or, when a later request already ran on it, the
sequence is *lost*: its state is dropped and its next requests (without a START) fail with
SequenceStateLost, never run on a state that counts a failed request.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.completion import settle
from asyncinfer.errors import InvalidRequest, ModelError, SequenceNotStarted, SequenceStateLost
from asyncinfer.models.base import Model
from asyncinfer.models.sequence import SequenceBatching
from asyncinfer.wire.protocol import Request
from asyncinfer.wire.sequence import SEQUENCE_ID, SequenceFlags, not_started_message, sequence_of

__all__ = ["SequenceBook", "request_sequence"]


@dataclass(eq=False)
class _Sequence:
    """One sequence as the book holds it."""

    id: int | str
    #: Its requests not yet handed to the batcher, in order.
    waiting: deque[WorkItem] = field(default_factory=deque)
    #: Its request in the batcher or on the device (at most one).
    running: WorkItem | None = None
    #: Its implicit state after its last request that succeeded (None: the initial state).
    state: Any = None
    #: Between a START and an END: later requests without START belong to it.
    live: bool = True
    last_used: float = 0.0
    #: The request whose state output ``state`` is ('' for none), and the state before it.
    kept_from: str = ""
    before: Any = None
    #: Why its state was lost (:meth:`SequenceBook.lose`): its requests without a START fail
    #: with this, until it starts again or is idle past the timeout. '': not lost.
    lost: str = ""


class SequenceBook:
    """The sequences of ``model`` (declaring ``spec``) on this worker; hands each sequence's
    next request to ``put`` (the batcher's) once the one before it is answered; tells
    ``on_released(sequence_id)`` when a sequence's state is released."""

    def __init__(self, spec: SequenceBatching, model: str, put: Callable[[WorkItem], None], *,
                 on_released: Callable[[int | str], None] = lambda sequence_id: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.model = model
        self._put = put
        self._on_released = on_released
        self._clock = clock
        self._sequences: dict[str, _Sequence] = {}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, model: Model, put: Callable[[WorkItem], None]) -> SequenceBook | None:
        """The book of ``model`` (None for a stateless one), handing requests to ``put``."""
        spec = model.sequence_batching
        if spec is None:
            return None
        if model.decoupled:
            raise ValueError(f"model {model.name}: a stateful model (sequence_batching) cannot "
                             f"be decoupled too")
        return cls(spec, model.name, put, on_released=model.end_sequence)

    def __len__(self) -> int:
        """How many sequences it holds."""
        return len(self._sequences)

    def busy(self) -> bool:
        """Whether a request of a sequence waits or runs here."""
        with self._lock:
            return any(seq.running is not None or seq.waiting for seq in self._sequences.values())

    def holds(self, flags: SequenceFlags) -> bool:
        """Whether a live sequence of ``flags``' ID is held (started, not ended, not released)."""
        with self._lock:
            seq = self._sequences.get(flags.key)
            return seq is not None and seq.live

    def submit(self, item: WorkItem, flags: SequenceFlags) -> None:
        """Queue ``item`` (one row of sequence ``flags``) behind the sequence's earlier requests.

        Raises:
            SequenceNotStarted: ``flags`` does not start its sequence and the book holds no live
                sequence of that ID.
        """
        with self._lock:
            seq = self._sequences.get(flags.key)
            if not flags.start and seq is not None and seq.lost:
                raise SequenceStateLost(f"request {item.request.id}: {seq.lost}")
            if seq is not None and seq.lost:  # a START begins it afresh
                seq = self._sequences[flags.key] = _Sequence(flags.id)
            if not flags.start and (seq is None or not seq.live):
                raise SequenceNotStarted(
                    f"request {item.request.id}: {not_started_message(flags, self.model)} (this "
                    f"worker holds no live sequence {flags.shown}: never started here, ended, or "
                    f"idle past the model's sequence timeout of {self.spec.idle_timeout_s:g} s)")
            if seq is None:
                seq = self._sequences[flags.key] = _Sequence(flags.id)
            if flags.start:
                seq.live = True
            if flags.end:
                seq.live = False
            item.sequence = flags
            seq.waiting.append(item)
            seq.last_used = self._clock()
            ready = self._next(seq)
        item.future.add_done_callback(functools.partial(self._on_done, flags.key, item))
        if ready is not None:
            self._put(ready)

    def inputs_for(self, items: Sequence[WorkItem]) -> dict[str, Any]:
        """The inputs the runner adds to a batch of ``items`` (in order): the declared control
        inputs and, with an implicit state, each row's state (zeros on a row that starts)."""
        flags = [item.sequence for item in items]
        out = self.spec.controls(flags)
        state = self.spec.state
        if state is not None:
            with self._lock:
                rows = [self._state_of(item) for item in items]
            out[state.input] = torch.cat(rows) if len(rows) > 1 else rows[0]
        return out

    def keep(self, items: Sequence[WorkItem], outputs: dict[str, Any],
             to_host: Callable[[Any], Any]) -> dict[str, Any]:
        """After a batch's forward: keep each item's sequence's new state — the rows, in order,
        of the state output (copied to the host with ``to_host``) — and return the other
        outputs (what the requests are answered with). No implicit state: ``outputs``."""
        state = self.spec.state
        if state is None:
            return outputs
        if state.output not in outputs:
            raise ModelError(f"model '{self.model}': its forward returned no state output "
                             f"'{state.output}'")
        outputs = dict(outputs)
        states = to_host(outputs.pop(state.output))
        rows = list(torch.split(states, 1)) if len(items) > 1 else [states]
        if len(rows) != len(items):
            raise ValueError(f"model '{self.model}': state output has {len(rows)} rows for a "
                             f"batch of {len(items)}")
        with self._lock:
            for item, row in zip(items, rows, strict=True):
                seq = self._sequences.get(item.sequence.key)
                if seq is not None and seq.running is item:
                    seq.before, seq.state = seq.state, row
                    seq.kept_from = item.request.id
        return outputs

    def void(self, request_id: str, why: str) -> str:
        """Request ``request_id`` ran here, but the fleet had already failed it (its result was
        left out): take back the state it left. 'reverted': its sequence's state is the one
        before it again (no later request ran on it); 'lost': a later request of the sequence
        ran (or runs) on it, or the request still runs, so the sequence's state is dropped — its
        waiting requests, and its next requests without a START, fail with SequenceStateLost
        (``why``); '': the book holds no sequence it touched."""
        with self._lock:
            key = next((k for k, seq in self._sequences.items()
                        if not seq.lost and (seq.kept_from == request_id
                                             or _holds(seq, request_id))), None)
            if key is None:
                return ""
            seq = self._sequences[key]
            if seq.kept_from == request_id and seq.running is None:
                seq.state, seq.before, seq.kept_from = seq.before, None, ""
                return "reverted"
            self._sequences[key] = _Sequence(seq.id, live=False, last_used=self._clock(),
                                             lost=why)
        for item in seq.waiting:
            if not item.future.done():
                settle(item.future, exc=SequenceStateLost(f"request {item.request.id}: {why}"))
        self._on_released(seq.id)
        return "lost"

    def expire(self) -> list[int | str]:
        """Release every sequence idle (nothing waiting or running) for ``idle_timeout_s``; the
        IDs released."""
        now = self._clock()
        with self._lock:
            idle = [key for key, seq in self._sequences.items()
                    if seq.running is None and not seq.waiting
                    and now - seq.last_used >= self.spec.idle_timeout_s]
            gone = [self._sequences.pop(key) for key in idle]
        for seq in gone:
            if not seq.lost:  # a lost one was released when it was lost
                self._on_released(seq.id)
        return [seq.id for seq in gone]

    def close(self) -> list[WorkItem]:
        """Release every sequence; the requests that waited and never reached the batcher."""
        with self._lock:
            sequences, self._sequences = list(self._sequences.values()), {}
        left = [item for seq in sequences for item in seq.waiting if not item.future.done()]
        for seq in sequences:
            self._on_released(seq.id)
        return left

    def _state_of(self, item: WorkItem) -> Any:
        assert self.spec.state is not None
        seq = self._sequences.get(item.sequence.key)
        if item.sequence.start or seq is None or seq.state is None:
            return self.spec.state.initial()
        return seq.state

    def _next(self, seq: _Sequence) -> WorkItem | None:
        """(Holding the lock.) The sequence's next request to hand over, if none runs."""
        if seq.running is not None:
            return None
        while seq.waiting:
            item = seq.waiting.popleft()
            if not item.future.done():  # revoked, expired or past a limit while it waited
                seq.running = item
                return item
        return None

    def _on_done(self, key: str, item: WorkItem, _future: Any) -> None:
        self._done(key, item)

    def _done(self, key: str, item: WorkItem) -> None:
        """``item``'s future is done: its sequence's next request may go; a sequence ended (or
        whose START was its only request and failed) with nothing left is released."""
        released: int | str | None = None
        with self._lock:
            seq = self._sequences.get(key)
            if seq is None:
                return
            if seq.running is item:
                seq.running = None
            elif item in seq.waiting:
                seq.waiting.remove(item)
            seq.last_used = self._clock()
            ready = self._next(seq)
            if (ready is None and seq.running is None and not seq.waiting and not seq.live
                    and not seq.lost):
                released = self._sequences.pop(key).id
        if ready is not None:
            self._put(ready)
        if released is not None:
            self._on_released(released)


def _holds(seq: _Sequence, request_id: str) -> bool:
    """Whether ``seq`` holds request ``request_id``, running or waiting."""
    return ((seq.running is not None and seq.running.request.id == request_id)
            or any(item.request.id == request_id for item in seq.waiting))


def request_sequence(book: SequenceBook | None, model: str, request: Request,
                     rows: int) -> SequenceFlags | None:
    """The sequence of ``request`` (``rows`` rows) for ``model``, whose sequences ``book`` holds
    (None: a stateless model), checked as Triton's sequence batcher checks it.

    Raises:
        InvalidRequest: a stateful model's request without a sequence ID, or of more than one
            row (Triton's words); a sequence's request for a stateless model; an ID the model's
            CORRID control cannot hold; a malformed sequence parameter.
    """
    sequence = sequence_of(request.parameters, f"request {request.id}")
    if book is None:
        if sequence is not None:
            raise InvalidRequest(
                f"request {request.id}: model '{model}' is not stateful (it declares no sequence "
                f"batching): parameter '{SEQUENCE_ID}' is not served for it")
        return None
    if sequence is None:
        raise InvalidRequest(
            f"request {request.id}: inference request to model '{model}' must specify a "
            f"non-zero or non-empty correlation ID (parameter '{SEQUENCE_ID}': the model is "
            f"stateful, it serves sequences)")
    if rows != 1:
        raise InvalidRequest(
            f"request {request.id}: inference request to model '{model}' must specify "
            f"batch-size 1 due to requirements of sequence batcher (it holds {rows} rows)")
    why = book.spec.accepts_id(sequence)
    if why is not None:
        raise InvalidRequest(f"request {request.id}: model '{model}' cannot take sequence "
                             f"{sequence.shown}: {why}")
    return sequence
