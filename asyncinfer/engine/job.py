"""One batch on its way through the runner's stages (engine/runner.py, engine/streaming.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncinfer.engine.batcher import WorkItem
from asyncinfer.models.base import Batch
from asyncinfer.wire.protocol import FORWARD_STAGE

__all__ = ["Job", "forward_only", "off_device"]


@dataclass
class Job:
    """One batch on its way through the stages."""

    items: list[WorkItem]
    started: float
    data: Batch = field(default_factory=dict)
    event: Any = None
    #: When it went onto the device, and how long the device took with it.
    launched: float = 0.0
    device_s: float | None = None
    #: A decoupled model's batch, streamed: its requests are answered already.
    streamed: bool = False
    #: A request run again alone after its batch raised: no other request joins its stream.
    isolated: bool = False
    #: In-flight batching: requests taken to join the stream whose preparation raised, and the
    #: error (each runs again alone once the stream ended).
    unprepared: list[WorkItem] = field(default_factory=list)
    unprepared_error: Exception | None = None


def forward_only(job: Job) -> bool:
    """Whether the batch holds prepared requests (the stages run as separate Celery tasks)."""
    return job.items[0].request.parameters.get("stage") == FORWARD_STAGE


def off_device(items: Sequence[WorkItem]) -> None:
    for item in items:
        item.on_device = False
