"""Which runner a worker's request for a model goes to: its model's versions hosted here, the
latest last (Triton's ``latest`` policy), and the weights that answer each under them (for the
response cache, worker/cache_generations.py). Pure functions of the runners; the runtime
(runtime.py) holds the routes and rebuilds them after each load, unhost or unload."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from asyncinfer.wire.model_versions import split_key, version_key, version_order

__all__ = ["Routes", "routes_of", "route", "answering"]

#: Model → its hosted runners' ``(key, version)``, the latest last.
Routes = dict[str, list[tuple[str, str]]]


def routes_of(runners: Mapping[str, Any], hosted: list[str] | None) -> Routes:
    """The routes of ``runners`` (key → a runner) hosted here (``hosted``; None: all)."""
    routes: Routes = {}
    for key, runner in runners.items():
        if hosted is None or key in hosted:
            routes.setdefault(split_key(key)[0], []).append((key, runner.model.version))
    for versions in routes.values():
        versions.sort(key=lambda kv: version_order(kv[1]))
    return routes


def route(routes: Routes, model: str, version: str) -> str | None:
    """The key of the runner a request for ``model`` (``version``) goes to: that version among
    those hosted, else the latest; ``model`` itself when none is loaded yet (loaded on first use,
    if hosted); None when ``version`` is not among them."""
    versions = routes.get(model)
    if versions is None:
        return model
    if version:
        return next((key for key, v in versions if v == version), None)
    return versions[-1][0]


def answering(routes: Routes, token_of: Callable[[str], str]) -> dict[str, str]:
    """Generation name → the token of the weights that answer it under ``routes``: each cached
    model (its latest) and each of its versions (``m@v``), as :func:`route` picks them
    (``token_of(key)``: "" for a runner whose answers are not cached)."""
    tokens: dict[str, str] = {}
    for model, versions in routes.items():
        latest = token_of(versions[-1][0])
        if latest:
            tokens[model] = latest
        seen: set[str] = set()
        for key, version in versions:
            if version not in seen:
                seen.add(version)
                token = token_of(key)
                if token:
                    tokens[version_key(model, version)] = token
    return tokens
