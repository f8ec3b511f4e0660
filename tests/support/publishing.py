"""One request through the grouped publisher, as a client sends it, for tests of the publish
script's rules."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from asyncinfer.broker.publisher import Publisher
from asyncinfer.client.grouped import GroupedPublisher

__all__ = ["publish_one"]


def publish_one(publisher: Publisher, queue: str, request_id: str, message: str,
                **options: Any) -> int:
    """Send one request in a group of its own: its status (PUBLISHED, DUPLICATE), or its error
    raised."""
    outcome: Future[int] = Future()

    def done(status: int | None, error: BaseException | None) -> None:
        if error is not None:
            outcome.set_exception(error)
        else:
            outcome.set_result(int(status or 0))

    grouped = GroupedPublisher(publisher, lambda request_id, exc: exc)  # type: ignore[arg-type,return-value]
    grouped.put(publisher.prepare(queue, request_id, message, **options), done)
    try:
        return outcome.result(timeout=30)
    finally:
        grouped.close()
