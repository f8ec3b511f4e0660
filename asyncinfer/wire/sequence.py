"""A request's place in a sequence (Triton's sequence batcher): the v2 parameters
``sequence_id`` (an unsigned 64-bit integer or a string; 0 and "" mean none, as in Triton),
``sequence_start`` and ``sequence_end``, read and checked in one place for the gateway, the
client's publish and the worker.

A sequence is named by its model and its ID *with its type*: ``1000`` and ``"1000"`` are two
sequences, as in Triton, whose correlation IDs are typed. :attr:`SequenceFlags.key` is that name
as text (``u1000`` / ``s1000``): the Redis pin's suffix and the worker's key of the sequence's
state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncinfer.errors import InvalidRequest

__all__ = ["SEQUENCE_ID", "SEQUENCE_START", "SEQUENCE_END", "SEQUENCE_PARAMETERS",
           "MAX_SEQUENCE_ID_CHARS", "SequenceFlags", "sequence_of", "not_started_message"]

SEQUENCE_ID, SEQUENCE_START, SEQUENCE_END = "sequence_id", "sequence_start", "sequence_end"
SEQUENCE_PARAMETERS = (SEQUENCE_ID, SEQUENCE_START, SEQUENCE_END)
#: The longest string sequence ID (it names a Redis key).
MAX_SEQUENCE_ID_CHARS = 256
_MAX_UINT64 = 2 ** 64 - 1


@dataclass(frozen=True)
class SequenceFlags:
    """One request's sequence: its ID (``int`` or ``str``), and whether it starts or ends it."""

    id: int | str
    start: bool = False
    end: bool = False

    @property
    def key(self) -> str:
        """The sequence's name with its type: ``u<int>`` or ``s<string>``."""
        return f"u{self.id}" if isinstance(self.id, int) else f"s{self.id}"

    @property
    def shown(self) -> str:
        """The ID as messages show it (Triton's: the number, or the string as it is)."""
        return str(self.id)


def sequence_of(parameters: Mapping[str, Any] | None, who: str = "") -> SequenceFlags | None:
    """The sequence of a request with v2 ``parameters`` (None: not part of one). ``who`` names
    the request in errors (``request 7``).

    Raises:
        InvalidRequest: a ``sequence_id`` that is neither an unsigned 64-bit integer nor a
            string of 1-256 printable characters, a flag that is not a boolean, or a flag
            without a ``sequence_id``.
    """
    if not parameters:
        return None
    value = parameters.get(SEQUENCE_ID)
    start, end = parameters.get(SEQUENCE_START, False), parameters.get(SEQUENCE_END, False)
    prefix = f"{who}: " if who else ""
    for name, flag in ((SEQUENCE_START, start), (SEQUENCE_END, end)):
        if type(flag) is not bool:
            raise InvalidRequest(f"{prefix}parameter '{name}' must be a boolean, got {flag!r:.40}")
    if value is None or (type(value) is int and value == 0) or value == "":
        if start or end:
            flag_name = SEQUENCE_START if start else SEQUENCE_END
            raise InvalidRequest(f"{prefix}parameter '{flag_name}' needs a non-zero "
                                 f"'{SEQUENCE_ID}' (the sequence it starts or ends)")
        return None
    if type(value) is int:
        if not 0 < value <= _MAX_UINT64:
            raise InvalidRequest(f"{prefix}parameter '{SEQUENCE_ID}' must be an unsigned 64-bit "
                                 f"integer or a string, got {value}")
    elif isinstance(value, str):
        if len(value) > MAX_SEQUENCE_ID_CHARS or not value.isprintable():
            raise InvalidRequest(f"{prefix}parameter '{SEQUENCE_ID}': a string ID holds 1-"
                                 f"{MAX_SEQUENCE_ID_CHARS} printable characters, got "
                                 f"{value!r:.60}")
    else:
        raise InvalidRequest(f"{prefix}parameter '{SEQUENCE_ID}' must be an unsigned 64-bit "
                             f"integer or a string, got {value!r:.40}")
    return SequenceFlags(value, start, end)


def not_started_message(sequence: SequenceFlags | str, model: str) -> str:
    """Triton's words for a request of a sequence that has not started (no START, or its state
    released: ended, or idle past the model's sequence timeout)."""
    shown = sequence.shown if isinstance(sequence, SequenceFlags) else sequence
    return (f"inference request for sequence {shown} to model '{model}' must specify the START "
            f"flag on the first request of the sequence")
