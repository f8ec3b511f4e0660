"""Model control from a client (:class:`ModelControl`, a part of
:class:`~asyncinfer.client.client.Client`): load and unload models across the fleet and read its
repository index (client/repository.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncinfer.client.repository import (
    DEFAULT_CONTROL_TIMEOUT_S,
    LOAD,
    UNLOAD,
    ControlOutcome,
    control,
    repositories,
    repository_index,
)

if TYPE_CHECKING:
    from celery import Celery

    from asyncinfer.broker.catalogue import CatalogueEntry
    from asyncinfer.client.brokers import BrokerGroup

__all__ = ["ModelControl"]


class ModelControl:
    """:class:`~asyncinfer.client.client.Client`'s model control calls."""

    if TYPE_CHECKING:  # the client's own
        def app_for(self, model: str) -> Celery: ...
        def apps(self) -> dict[str, Celery]: ...
        def _group_for(self, model: str | None) -> BrokerGroup: ...
        def models(self, *, stale_ok: bool = False) -> dict[str, CatalogueEntry]: ...

    def load_model(self, model: str, *, version: str | int | None = None,
                   workers: Sequence[str] = (), devices: Sequence[str] = (),
                   timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S) -> ControlOutcome:
        """Load ``model`` (``version``: that version, registered as ``model@version``) on
        ``workers`` (default: every live device worker), or on the workers of ``devices``
        (``cuda:0``, ``cpu``), and start serving it there; waits up to ``timeout_s`` for their
        answers. ``outcome.ok`` when every worker asked loaded it; ``outcome.message()`` says
        what failed where, and why."""
        return self._control(LOAD, model, version, workers, devices, timeout_s)

    def unload_model(self, model: str, *, version: str | int | None = None,
                     workers: Sequence[str] = (), devices: Sequence[str] = (),
                     timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S,
                     grace_s: float | None = None) -> ControlOutcome:
        """Unload ``model`` (every version; ``version``: that one, the others serving on) from
        ``workers`` (default: every worker hosting it), or from the workers of ``devices``: each
        stops taking its queue, gives back what it holds and has not started, finishes what is
        on its device (up to ``grace_s``) and frees the memory."""
        return self._control(UNLOAD, model, version, workers, devices, timeout_s, grace_s)

    def _control(self, action: str, model: str, version: str | int | None,
                 workers: Sequence[str], devices: Sequence[str], timeout_s: float,
                 grace_s: float | None = None) -> ControlOutcome:
        outcome = control(self.app_for(model), action, model, self.models(stale_ok=True),
                          workers=workers, devices=devices,
                          version="" if version is None else str(version),
                          timeout_s=timeout_s, grace_s=grace_s)
        group = self._group_for(model)
        if group.known is not None:  # the unknown-model check reads the catalogue again
            group.known.forget()
        return outcome

    def repository_index(self, *, ready_only: bool = False) -> list[dict[str, str]]:
        """Triton's repository index of the fleet: every model it knows or could load, per
        version, with its state (READY, UNAVAILABLE) and why (client/repository.py)."""
        entries = self.models(stale_ok=True)
        workers: dict[str, Any] = {}
        for app in self.apps().values():
            workers.update(repositories(app, entries))
        return repository_index(entries, workers, ready_only=ready_only)
