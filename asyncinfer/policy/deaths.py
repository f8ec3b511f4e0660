"""Deaths on a device, one policy (the fleet's leases count them: broker/leases.py).

Most deaths are the host's (a host lost, a spot instance reclaimed, an out-of-memory kill of the
whole process), not a request's. So after its first death a request is a *suspect*: it runs again
in a batch of suspects only (its batch-mates, which come back with it, at the front of the queue),
with the device to itself (engine/gate.py): an innocent loss costs the survivor about one batch
time, not one per row. A request that sees a second death runs in a batch of its own, so it cannot
take good requests down again; at ``ASYNCINFER_MAX_WORKER_DEATHS`` (3) deaths it fails for good
with :class:`WorkerLost`. A killer among the B rows of a batch thus costs 3 deaths: its batch, the
suspects' rerun, its own; a good request runs at most 3 times (its batch, the rerun, alone), and
answers after the first rerun unless it shared that with a killer. Below 3 there is no room for the
rerun: a request runs alone after its first death (and fails at the bound), as before. A hang
(engine/hangs.py) is never the host's fault: it counts as two deaths, so a hung batch's requests
run alone at once and a request that hangs two devices fails (the pipeline reads the hang's
note)."""

from __future__ import annotations

from asyncinfer.errors import WorkerLost
from asyncinfer.policy.admission import REFUSED, Admission

__all__ = ["WorkerDeaths"]


class WorkerDeaths:
    """At most ``max_deaths`` deaths a request (0: deaths are not counted)."""

    def __init__(self, max_deaths: int = 0) -> None:
        self.max_deaths = max_deaths

    @staticmethod
    def counted(deaths: int, hung: bool = False) -> int:
        """What ``deaths`` count for: one more when a hang was among them (``hung``), since a
        device that hangs is never the host's fault."""
        return deaths + 1 if hung and deaths else deaths

    def judge(self, request_id: str, deaths: int, hung: bool = False) -> Admission | None:
        """REFUSED with :class:`WorkerLost` once ``deaths`` (a hang among them: ``hung``) count
        for the bound; else None."""
        if not self.max_deaths or self.counted(deaths, hung) < self.max_deaths:
            return None
        twice = " (a hang counts as two deaths)" if hung else ""
        return Admission(REFUSED, error=WorkerLost(
            f"request {request_id}: worker processes died {deaths} times while this request was "
            f"on their device{twice} (ASYNCINFER_MAX_WORKER_DEATHS={self.max_deaths}); it may be "
            f"what kills them, so it is not run again"))

    def suspect(self, deaths: int, hung: bool = False) -> bool:
        """Whether a request runs in a batch of suspects (one death so far, not a hang, with room
        for more before the bound: its batch-mates run again with it)."""
        return self.counted(deaths, hung) == 1 and self.max_deaths >= 3

    def alone(self, deaths: int, hung: bool = False) -> bool:
        """Whether a request runs in a device batch of its own (workers died with it on the
        device more than once, or hung, or died once with no room for a rerun)."""
        return deaths > 0 and not self.suspect(deaths, hung)
