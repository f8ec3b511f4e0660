"""A sequence's calls, handed to the publisher in the order they came (sequence batching: the
publish script pins and routes them in the order it gets them, broker/publisher.py).

The calls of a gRPC stream go out together, each in a task of its own; one may be encoded off the
event loop (a large one, or one whose model must first be checked against the catalogue) and the
next not, and so reach the publisher first. Each call of a sequence waits here until the call of
the same sequence before it was handed over (or failed)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["SequenceOrder"]

T = TypeVar("T")


class SequenceOrder:
    """The last call being handed over, per sequence (any hashable key: model and sequence)."""

    def __init__(self) -> None:
        self._last: dict[object, asyncio.Future[None]] = {}

    def __len__(self) -> int:
        return len(self._last)

    async def send(self, sequence: object, send: Callable[[], Awaitable[T]]) -> T:
        """``await send()`` once every earlier call of ``sequence`` was handed over."""
        previous = self._last.get(sequence)
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._last[sequence] = mine
        try:
            if previous is not None:
                await asyncio.wait([previous])
            return await send()
        finally:
            mine.set_result(None)
            if self._last.get(sequence) is mine:
                del self._last[sequence]
