"""``Client.map``'s window: requests sent with a bounded number in flight, answers yielded in
input order while later requests are still being sent, and an optional progress bar.

Sending everything first held every input's message and future in memory at once and returned
nothing until the last was sent (20,000 rows: the first answer after 3.8 s). With a window of W,
at most W requests wait for their answers: the next one is sent as soon as the oldest is answered,
so memory is bounded by W, not by the input, and the first answer comes after the first group.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

from tqdm import tqdm

__all__ = ["DEFAULT_WINDOW", "Answering", "Pending", "windowed"]

_Answer = TypeVar("_Answer")
_Answer_co = TypeVar("_Answer_co", covariant=True)


class Pending(Protocol[_Answer_co]):
    """What the window waits on: an :class:`~asyncinfer.client.responses.InferFuture` (``map``),
    or a caller's own, such as ``asyncinfer infer --input-file``'s line, which answers with its
    error instead of raising it, so that one failed request does not end the others."""

    def result(self, timeout: float | None = None) -> _Answer_co: ...

    def done(self) -> bool: ...

class Answering:
    """One item on its way (a line of ``asyncinfer infer --input-file``, a row of a job) that
    answers with itself, its response or its error, so that one that fails does not end the
    window for the others. ``future`` None: nothing was sent, ``error`` says why. Its wait counts
    from when it was sent (``timeout_s``), not from its turn. A broker gone ends the window (every
    item after it would say the same); any other error is the item's, in :meth:`said`'s words."""

    def __init__(self, number: int, *, future: Any = None, error: str | None = None,
                 timeout_s: float | None = None) -> None:
        self.number = number
        self.future = future
        self.error = error
        self.response: Any = None
        self.timeout_s = timeout_s
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def result(self, timeout: float | None = None) -> Any:
        """This item, answered within its own deadline (``timeout`` is unused)."""
        from asyncinfer.errors import BrokerUnavailable

        if self.future is None or self.response is not None or self.error is not None:
            return self
        left_s = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        try:
            self.response = self.future.result(timeout=left_s)
        except BrokerUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - this item's error; the others go on
            self.error = self.said(exc)
        return self

    def said(self, exc: Exception) -> str:
        """The item's error in words."""
        return f"{type(exc).__name__}: {exc}"


#: Requests a ``map`` keeps in flight by default: enough for full device batches on a fleet of
#: several workers, little enough that a large input is not held whole.
DEFAULT_WINDOW = 1024


def windowed(submit: Callable[[Any], Pending[_Answer]], inputs: Iterable[Any], *, window: int,
             timeout_s: float | None, forget: Callable[[Any], None],
             progress: bool | None = False, description: str = "") -> Iterator[_Answer]:
    """Submit each of ``inputs`` with ``submit``, at most ``window`` unanswered at a time; yield
    the responses in input order. A request refused raises its error at its turn. Futures not
    answered when the caller stops are handed to ``forget``. ``progress``: a bar on stderr (rows
    done, rows/s, time left when the input has a length; None: when stderr is a terminal)."""
    if window < 1:
        raise ValueError(f"map: window must be at least 1, got {window}")
    show = sys.stderr.isatty() if progress is None else progress
    total = len(inputs) if hasattr(inputs, "__len__") else None  # type: ignore[arg-type]
    bar = tqdm(total=total, desc=description or None, unit="row", disable=not show,
               file=sys.stderr, dynamic_ncols=True)
    in_flight: deque[Pending[_Answer]] = deque()
    try:
        for one in inputs:
            in_flight.append(submit(one))
            if len(in_flight) >= window:
                yield _answer(in_flight, timeout_s, bar)
        while in_flight:
            yield _answer(in_flight, timeout_s, bar)
    finally:
        bar.close()
        for future in in_flight:
            if not future.done():
                forget(future)


def _answer(in_flight: deque[Pending[_Answer]], timeout_s: float | None, bar: tqdm) -> _Answer:
    """The oldest request's response (its error raised), counted on ``bar``."""
    future = in_flight[0]
    try:
        return future.result(timeout=timeout_s)
    finally:
        in_flight.popleft()
        bar.update(1)
