"""A decoupled model's stream entries as the result writer (result_writer.py) appends them.

The entries queued since the last write (starts, parts) and the ``final`` of each outcome go to
the streams (stream_write.py) in one script call on the results' Redis, before the results are
stored; nothing is called for a batch without them. A try that Redis refused (it may have run it)
is tried again with the batch, and the appends skip what is there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from asyncinfer.worker.output.stream_write import StreamAppend, StreamScript, final_entry
from asyncinfer.worker.requests.taken import TakenMessage

__all__ = ["Ended", "StreamAppends"]

log = logging.getLogger(__name__)


class Ended(Protocol):
    """How a request ended, as its stream's ``final`` needs it (result_writer.Outcome)."""

    @property
    def delivery(self) -> TakenMessage: ...

    @property
    def state(self) -> str: ...

    @property
    def result(self) -> Any: ...

    @property
    def store(self) -> bool: ...


class StreamAppends:
    """The stream entries of the batch being written, appended with a :class:`StreamScript`
    (stream_write.py)."""

    def __init__(self) -> None:
        #: Stream entries of the batch being written, not yet appended; whether a try to append
        #: them failed (Redis may have run it).
        self._appends: list[StreamAppend] = []
        self._appends_tried = False

    def begin(self, appends: list[StreamAppend]) -> None:
        """The entries queued for the batch about to be written (appended with its first part)."""
        self._appends, self._appends_tried = appends, False

    def append(self, part: Sequence[Ended], script: StreamScript) -> None:
        """Append the stream entries queued (the first part of a batch) and the ``final`` of
        each outcome of ``part`` (as it is stored now), before ``part`` is stored; raises what
        Redis refuses, for the batch to be tried again (the appends skip what is there). ``script``:
        the streams' script on the results' Redis."""
        finals = [f for f in (final_entry(o.delivery, o.state, o.result) for o in part
                              if o.delivery.stream_max_parts and o.store) if f is not None]
        appends = self._appends + finals
        if not appends:
            return
        again, self._appends_tried = self._appends_tried, True
        _, errors = script(appends, again=again)
        self._appends, self._appends_tried = [], False
        for error in errors:
            log.error("a stream append was refused by Redis: %s", error)
