"""Deaths on a device, one policy (the fleet's leases count them: broker/leases.py): a
request that was on a device when its worker died runs next time in a device batch of its own, with
the device to itself (engine/gate.py), so it cannot take good requests down again; after
``ASYNCINFER_MAX_WORKER_DEATHS`` such deaths it fails for good with :class:`WorkerLost`."""

from __future__ import annotations

from asyncinfer.errors import WorkerLost
from asyncinfer.policy.admission import REFUSED, Admission

__all__ = ["WorkerDeaths"]


class WorkerDeaths:
    """At most ``max_deaths`` deaths a request (0: deaths are not counted)."""

    def __init__(self, max_deaths: int = 0) -> None:
        self.max_deaths = max_deaths

    def judge(self, request_id: str, deaths: int) -> Admission | None:
        """REFUSED with :class:`WorkerLost` once ``deaths`` reach the bound; else None."""
        if not self.max_deaths or deaths < self.max_deaths:
            return None
        return Admission(REFUSED, error=WorkerLost(
            f"request {request_id}: worker processes died {deaths} times while this request was "
            f"on their device (ASYNCINFER_MAX_WORKER_DEATHS={self.max_deaths}); it may be what "
            f"kills them, so it is not run again"))

    @staticmethod
    def alone(deaths: int) -> bool:
        """Whether a request runs in a device batch of its own (a worker died with it on the
        device: no bystanders now)."""
        return deaths > 0
