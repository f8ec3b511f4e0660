"""A message a worker took from a queue, with the worker's bookkeeping of it, until its result is
stored and it is acknowledged. The message itself (its text, its kombu envelope) is wire's
:class:`~asyncinfer.wire.envelope.Message`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncinfer.wire.envelope import Message

__all__ = ["TakenMessage"]


@dataclass
class TakenMessage(Message):
    """One message taken from a queue, until its result is stored and it is acknowledged."""

    #: ``time.perf_counter()`` when the worker took it (the start of its ``queue_ms``).
    received_at: float = 0.0
    #: The shard it was taken from (its worker's intake: worker/consumers/shard_intake.py), where
    #: its result and bookkeeping live; 0 but on a cluster that spreads requests.
    shard: int = 0
    #: Whether its STARTED state is stored already (by the take).
    started: bool = False
    #: Worker deaths counted against its request while it was on a device (leases).
    deaths: int = 0
    #: Leased to another worker now (this one renewed too late): it must not start here
    #: (worker/requests/lease_gate.py).
    lost: bool = False
    #: kombu's message, when Celery's consumer received it: acknowledged through kombu
    #: (output/kombu_acks.py). None: taken from the Redis lists by the take script, recorded in
    #: their bookkeeping (acknowledged by the store script, leased, given back by the consumer).
    message: Any = None
    #: Its response cache entry, to fill with its answer ('' for none: broker/response_cache.py).
    cache_key: str = ""
    #: A decoupled model's request: its stream (wire/stream.py) holds at most this many entries
    #: (the model's ``stream_max_parts``). 0: it has no stream (its model answers at once, or it
    #: never reached one).
    stream_max_parts: int = 0
    #: The device batch it ran in (engine/completion.py's BatchRecord), when tracing records
    #: batches; None otherwise.
    batch: Any = None
