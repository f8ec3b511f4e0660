"""Redis commands written into the wire protocol by hiredis in one C call, for every redis-py
connection the project opens (broker/connections.py).

redis-py with hiredis installed still passes each argument through its ``Encoder.encode`` (three
``isinstance`` checks and a generator step an argument) before ``hiredis.pack_command``: a
request's publish script call carries ~24 arguments, and packing it took ~17 µs against ~3 µs
for ``hiredis.pack_command`` alone (2026-12-06, this host), on the gateway's and every producer's
publishing thread. hiredis takes str (UTF-8, as redis-py's default encoding), bytes, int, float
and memoryview itself and writes numbers as ``repr`` does; anything else (a bool, None, a
bytearray) goes to redis-py's own packer, which raises redis-py's DataError for what it refuses.
"""

from __future__ import annotations

from typing import Any

from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer

try:
    import hiredis
except ImportError:  # a dependency; without it redis-py packs as it always does
    hiredis = None  # type: ignore[assignment]

__all__ = ["HiredisPacker", "connection_kwargs"]

#: redis-py's default: values longer than this go out as their own chunks (no copy).
_BUFFER_CUTOFF = 6000


class HiredisPacker:
    """A redis-py ``command_packer``: ``pack(*args)`` → the command's bytes (a one-item list).
    Stateless: one serves every connection."""

    def __init__(self) -> None:
        self._fallback = PythonRespSerializer(_BUFFER_CUTOFF,
                                              Encoder("utf-8", "strict", False).encode).pack

    def pack(self, *args: Any) -> list[bytes]:
        first = args[0]
        # redis-py's rule: a command name with spaces is several words ("CLIENT SETNAME")
        if (type(first) is str and " " in first) or (type(first) is bytes and b" " in first):
            args = (*first.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:  # a type hiredis does not take: redis-py's way (and its errors)
            return list(self._fallback(*args))


def connection_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for a redis-py client, with a hiredis packer (one a client: its connections
    share it) unless one is given."""
    if hiredis is None or "command_packer" in kwargs:
        return kwargs
    return {**kwargs, "command_packer": HiredisPacker()}
