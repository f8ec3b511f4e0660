"""A client's unknown-model check: a model the fleet never announced is refused at submit.

It reads the model catalogue (broker/catalogue.py) at most every ``KNOWN_FOR_S`` while the models asked
for are among those known; a model not among them is looked up again at once, so a model
announced a moment ago is never refused. The same read gives each model's declared inputs
(:meth:`KnownModels.signature`, wire/signature.py), which the client checks a request against
before it sends it: no read of its own.
"""

from __future__ import annotations

import time

import redis

from asyncinfer.broker.catalogue import Catalogue, CatalogueEntry
from asyncinfer.errors import UnknownModel
from asyncinfer.wire.signature import Signature
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
        #: (read at, the signatures a client checks requests against then, by model): one tuple,
        #: so that another thread's read replaces both at once.
        self._signatures: tuple[float, dict[str, Signature]] = (-1e9, {})
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
        self._signatures = (-1e9, {})

    def signature(self, model: str) -> Signature | None:
        """The declared inputs a request for ``model`` is checked against before it is sent, as
        the last read of the catalogue (by :meth:`check`) gave them; None, and the request goes
        unchecked (its worker checks it anyway), when that read is older than ``KNOWN_FOR_S`` or
        the catalogue could not be read, or the entry announces no signature to check by, or
        it is stale: no live worker hosts the model (the one started next may be another
        build), or its workers host more than one version of it."""
        read_at, signatures = self._signatures
        if time.monotonic() - read_at >= self.KNOWN_FOR_S:
            return None
        return signatures.get(model)

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
            entries = self.catalogue.read()
        except redis.RedisError:
            # A read that waited out its timeout (a frozen Redis) is not waited on again soon.
            now = time.monotonic()
            self._unreadable_until = now + max(self.KNOWN_FOR_S, 3 * (now - began))
            return
        known = frozenset(entries)
        read_at = time.monotonic()
        self._signatures = (read_at, _signatures(entries))
        self._known = (read_at, known)
        if known and model not in known:
            who = f" (request {request_id})" if request_id else ""
            raise UnknownModel(
                f"{unknown_model(model)}{who}: no worker announced it in the last "
                f"{_duration(self.retention_s)} (known: {', '.join(sorted(known))}); "
                f"start a worker that hosts it (asyncinfer worker --models {model})")


def _signatures(entries: dict[str, CatalogueEntry]) -> dict[str, Signature]:
    """The signatures a client checks requests against: of the models live workers host in one
    version, that announce one (wire/signature.py)."""
    found = {}
    for name, entry in entries.items():
        if entry.ready and len(entry.versions) == 1:
            signature = Signature.of(name, entry.metadata)
            if signature is not None:
                found[name] = signature
    return found


def _duration(seconds: float) -> str:
    """``86400`` → ``24 h``, ``90`` → ``90 s``."""
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds:g} s"
