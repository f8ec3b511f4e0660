"""A message a worker took from a queue, with the worker's bookkeeping of it, until its result is
stored and it is acknowledged. Its kombu envelope is read by :mod:`asyncinfer.wire.envelope`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TakenMessage"]


@dataclass
class TakenMessage:
    """One message taken from a queue, until its result is stored and it is acknowledged."""

    raw: bytes
    queue: str
    received_at: float
    envelope: dict[str, Any] = field(default_factory=dict)
    tag: str = ""
    request_id: str = ""
    #: The Redis list it came from: the queue's, or one of its priority lists.
    key: str = ""
    #: Whether its STARTED state is stored already (by the take).
    started: bool = False
    #: Worker deaths counted against its request while it was on a device (leases).
    deaths: int = 0

    @property
    def list_key(self) -> str:
        """Where the message goes back to (a retry, a restore): the list it came from."""
        return self.key or self.queue

    @property
    def headers(self) -> dict[str, Any]:
        headers = self.envelope.get("headers")
        return headers if isinstance(headers, dict) else {}

    @property
    def unacked_entry(self) -> str:
        """What kombu keeps in its ``unacked`` hash for this message."""
        info = (self.envelope.get("properties") or {}).get("delivery_info") or {}
        return json.dumps([self.envelope, info.get("exchange", ""), info.get("routing_key", self.queue)])
