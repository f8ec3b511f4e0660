"""The live model catalogue: which models the fleet hosts, on which workers, with what metadata.

Each worker announces its models every few seconds (worker/announcer.py) and withdraws them when it
stops; an announcement lives ``ttl_s`` (a worker killed outright drops out when it passes). A model
stays *known* for ``retention_s`` after its last announcement: a known model with no live worker is
still queued (an autoscaler may be starting one from zero) and reports not ready; a model the fleet
never announced in that window is refused at submit (``UnknownModel``). Times are Redis' own
(``TIME`` inside the scripts), so hosts with skewed clocks agree.

Redis keys (keys.py): ``asyncinfer:models:live`` (sorted set ``model\\tworker`` → expiry),
``…:hosts`` (hash, same member → the worker's device), ``…:known`` (sorted set model → last
announced), ``…:meta`` (hash model → metadata JSON). Every key has a TTL of the retention window.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncinfer.broker.scripts import script
from asyncinfer.wire.keys import (
    CATALOGUE_HOSTS_KEY,
    CATALOGUE_KNOWN_KEY,
    CATALOGUE_LIVE_KEY,
    CATALOGUE_META_KEY,
)
from asyncinfer.wire.model_versions import sorted_versions

__all__ = ["Catalogue", "CatalogueEntry", "Host", "DEFAULT_TTL_S", "DEFAULT_RETENTION_S"]

DEFAULT_TTL_S = 15.0
DEFAULT_RETENTION_S = 86400.0

_KEYS = [CATALOGUE_LIVE_KEY, CATALOGUE_KNOWN_KEY, CATALOGUE_META_KEY, CATALOGUE_HOSTS_KEY]

_ANNOUNCE = script("catalogue_announce")
_READ = script("catalogue_read")

_SEP = "\t"


@dataclass(frozen=True)
class Host:
    """One live worker hosting a model."""

    worker: str
    device: str = ""
    pid: int = 0
    #: The model's versions it hosts (empty: as the metadata says).
    versions: tuple[str, ...] = ()


@dataclass(frozen=True)
class CatalogueEntry:
    """One known model: its metadata as last announced and the live workers hosting it.

    ``metadata`` has the v2 model metadata keys (``name``, ``versions``, ``platform``, ``inputs``,
    ``outputs``, each tensor ``{"name", "datatype", "shape"}`` with -1 for the batch dimension)
    and ``max_batch_size``.
    """

    name: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    hosts: tuple[Host, ...] = ()

    @property
    def ready(self) -> bool:
        """At least one live worker hosts it."""
        return bool(self.hosts)

    @property
    def versions(self) -> list[str]:
        """The versions its live hosts host (every one's, in order), else those last announced."""
        hosted = {v for h in self.hosts for v in h.versions}
        if hosted:
            return sorted_versions(hosted)
        return [str(v) for v in self.metadata.get("versions") or ["1"]]

    def hosts_of(self, version: str) -> tuple[Host, ...]:
        """The live hosts of ``version`` (every host for a model announced without versions)."""
        return tuple(h for h in self.hosts if not h.versions or version in h.versions)

    def as_dict(self) -> dict[str, Any]:
        """What ``asyncinfer models --json`` and ``Client.models()`` users read."""
        return {**self.metadata, "name": self.name, "ready": self.ready, "versions": self.versions,
                "workers": [{"worker": h.worker, "device": h.device, "pid": h.pid,
                             "versions": list(h.versions)} for h in self.hosts]}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Catalogue:
    """Reads and writes the catalogue on a Redis client (the result backend's)."""

    def __init__(self, client: Any, *, ttl_s: float = DEFAULT_TTL_S,
                 retention_s: float = DEFAULT_RETENTION_S) -> None:
        self.client = client
        self.ttl_s = float(ttl_s)
        self.retention_s = float(retention_s)
        self._announce = client.register_script(_ANNOUNCE)
        self._read = client.register_script(_READ)

    def announce(self, worker: str, models: Iterable[Mapping[str, Any]], *, device: str = "",
                 pid: int = 0) -> None:
        """Say (again) that ``worker`` hosts ``models`` (their metadata dicts, each with ``name``)."""
        args: list[Any] = [self.ttl_s, max(self.retention_s, self.ttl_s)]
        for meta in models:
            name = str(meta["name"])
            host = json.dumps({"worker": worker, "device": device, "pid": pid,
                               "versions": [str(v) for v in meta.get("versions") or ["1"]]})
            args += [name, name + _SEP + worker, json.dumps(dict(meta), sort_keys=True), host]
        if len(args) > 2:
            self._announce(keys=_KEYS, args=args)

    def withdraw(self, worker: str, models: Iterable[str]) -> None:
        """``worker`` no longer hosts ``models`` (it stops): they leave the live set at once."""
        members = [m + _SEP + worker for m in models]
        if members:
            pipe = self.client.pipeline()
            pipe.zrem(CATALOGUE_LIVE_KEY, *members)
            pipe.hdel(CATALOGUE_HOSTS_KEY, *members)
            pipe.execute()

    def read(self) -> dict[str, CatalogueEntry]:
        """Every model known within the retention window, with its live hosts, by name."""
        live, hosts, known, metas = self._read(keys=_KEYS, args=[max(self.retention_s, self.ttl_s)])
        by_model: dict[str, list[Host]] = {}
        for member, raw in zip(live, hosts, strict=True):
            model, _, worker = _text(member).partition(_SEP)
            info = json.loads(_text(raw)) if raw else {}
            by_model.setdefault(model, []).append(
                Host(worker=worker, device=str(info.get("device", "")), pid=int(info.get("pid", 0)),
                     versions=tuple(str(v) for v in info.get("versions") or ())))
        entries = {}
        for name, raw in zip(known, metas, strict=True):
            model = _text(name)
            meta = json.loads(_text(raw)) if raw else {"name": model}
            entries[model] = CatalogueEntry(model, meta, tuple(sorted(by_model.get(model, []),
                                                                      key=lambda h: h.worker)))
        return dict(sorted(entries.items()))
