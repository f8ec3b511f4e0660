"""Forward marks: the test models "sleep" and "poison" note each batch they start on the device
(when ``FORWARD_MARKS_URL`` is set, as for the session worker), so a test can wait until its
request's batch is on the device instead of sleeping."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import redis

from asyncinfer.broker.connections import redis_client
from tests.support.waiting import wait_for

__all__ = ["FORWARD_MARKS_ENV", "ForwardMarks", "forward_marks_key", "mark_forward", "marks_client"]

#: The Redis URL the marks go to; unset: no marks.
FORWARD_MARKS_ENV = "FORWARD_MARKS_URL"
#: How long a model's marks are kept after its last batch (seconds).
MARKS_TTL_S = 3600


def forward_marks_key(model: str) -> str:
    """The list of ``model``'s batches: one JSON list of the batch's row values per batch."""
    return f"test:forward:{model}"


def marks_client() -> redis.Redis | None:
    """The client a model marks with, from ``FORWARD_MARKS_URL`` (None when unset)."""
    url = os.environ.get(FORWARD_MARKS_ENV)
    return redis_client(url) if url else None


def mark_forward(r: redis.Redis | None, model: str, rows: Sequence[float]) -> None:
    """Note that a batch of ``rows`` of ``model`` is starting its forward."""
    if r is None:
        return
    key = forward_marks_key(model)
    pipe = r.pipeline(transaction=False)
    pipe.rpush(key, json.dumps([float(v) for v in rows]))
    pipe.expire(key, MARKS_TTL_S)
    pipe.execute()


class ForwardMarks:
    """The batches of ``model`` started from now on (marks made before it was made don't count)."""

    def __init__(self, r: redis.Redis, model: str) -> None:
        self.r = r
        self.key = forward_marks_key(model)
        self.since = int(r.llen(self.key))

    def batches(self) -> list[list[float]]:
        """The row values of each batch started since."""
        return [json.loads(m) for m in self.r.lrange(self.key, self.since, -1)]

    def wait_on_device(self, value: float, timeout_s: float = 30.0) -> list[float]:
        """Wait until a batch holding a row of ``value`` has started its forward; return its rows."""
        return wait_for(lambda: next((b for b in self.batches() if value in b), None), timeout_s,
                        f"a batch of {self.key} with {value} on the device", poll_s=0.01)
