"""A client's unknown-model check: a model the fleet never announced is refused at submit.

It reads the model catalogue (broker/catalogue.py) at most every ``KNOWN_FOR_S`` while the models asked
for are among those known; a model not among them is looked up again at once, so a model
announced a moment ago is never refused.
"""

from __future__ import annotations

import time

import redis

from asyncinfer.broker.catalogue import Catalogue
from asyncinfer.errors import UnknownModel
from asyncinfer.wire.triton_words import unknown_model

__all__ = ["KnownModels"]


class KnownModels:
    """Refuses what ``catalogue`` does not know within ``retention_s`` (0: nothing is refused).

    While the fleet has announced nothing at all, nothing is refused either.
    """

    #: How long one read of the catalogue serves the check.
    KNOWN_FOR_S = 2.0

    def __init__(self, catalogue: Catalogue, retention_s: float) -> None:
        self.catalogue = catalogue
        self.retention_s = retention_s
        #: (read at, models known then).
        self._known: tuple[float, frozenset[str]] = (-1e9, frozenset())
        #: Until when (monotonic) a catalogue that could not be read is not tried again.
        self._unreadable_until = -1e9

    def fresh(self, model: str) -> bool:
        """Whether :meth:`check` can judge ``model`` now without reading the catalogue."""
        read_at, known = self._known
        now = time.monotonic()
        return (not self.retention_s or now < self._unreadable_until
                or (model in known and now - read_at < self.KNOWN_FOR_S))

    def forget(self) -> None:
        """Read the catalogue again at the next check (a model was loaded or unloaded)."""
        self._known = (-1e9, frozenset())

    def check(self, model: str, request_id: str = "") -> None:
        """Raise UnknownModel for a model not known. A catalogue that cannot be read now (a
        failover under way, a Redis that is down, an ACL that refuses its keys) leaves nothing
        to judge by: the model passes, the submit itself says whether the broker answers, and
        the catalogue is not tried again for ``KNOWN_FOR_S``, or three times as long as the
        failed read waited."""
        if not self.retention_s:
            return
        if self.fresh(model):
            return
        began = time.monotonic()
        try:
            known = frozenset(self.catalogue.read())
        except redis.RedisError:
            # A read that waited out its timeout (a frozen Redis) is not waited on again soon.
            now = time.monotonic()
            self._unreadable_until = now + max(self.KNOWN_FOR_S, 3 * (now - began))
            return
        self._known = (time.monotonic(), known)
        if known and model not in known:
            who = f" (request {request_id})" if request_id else ""
            raise UnknownModel(
                f"{unknown_model(model)}{who}: no worker announced it in the last "
                f"{_duration(self.retention_s)} (known: {', '.join(sorted(known))}); "
                f"start a worker that hosts it (asyncinfer worker --models {model})")


def _duration(seconds: float) -> str:
    """``86400`` → ``24 h``, ``90`` → ``90 s``."""
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds:g} s"
