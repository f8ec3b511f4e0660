"""The routing table of a sharded fleet: which broker (Redis) serves each model.

``ASYNCINFER_BROKER_ROUTES`` maps model names (or glob patterns of them) to broker URLs; the first
entry that matches a model wins, and a model no entry matches goes to the default broker
(``ASYNCINFER_BROKER_URL``, or what ``asyncinfer up`` published). Two forms:

- inline: ``resnet50=redis://a:6379/0;bert-*=redis://b:6379/0`` (entries separated by ``;``; a
  Sentinel URL's own ``;sentinel://…`` parts stay with its entry);
- a JSON file: ``@/etc/asyncinfer/routes.json`` (or any value ending ``.json``) holding one
  object ``{"resnet50": "redis://a:6379/0", "bert-*": "redis://b:6379/0"}``, in order.

Queues are per model (``infer.<model>``) and nothing of a request is shared between models, so
each group of models lives on its own Redis: its queues, results, leases and catalogue.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from asyncinfer.broker.urls import URL_EXAMPLES, is_sentinel_url, masked_url

__all__ = ["Route", "Routes", "ROUTES_VARIABLE"]

ROUTES_VARIABLE = "ASYNCINFER_BROKER_ROUTES"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
#: What a pattern may hold: the characters of model names, and glob's ``* ? [ ] !``.
_PATTERN = re.compile(r"^[A-Za-z0-9_.:\-*?\[\]!]+$")
_RULE = ("an entry is MODEL=URL or PATTERN=URL (glob: bert-*), entries separated by ';', "
         "e.g. resnet50=redis://a:6379/0;bert-*=redis://b:6379/0")


@dataclass(frozen=True)
class Route:
    """One entry: the models ``pattern`` matches (a name or a glob) go to ``url``."""

    pattern: str
    url: str

    def matches(self, model: str) -> bool:
        return fnmatch.fnmatchcase(model, self.pattern)


class Routes:
    """Model → broker URL: the first entry whose pattern matches, else ``default_url``.

    Empty (no entries) it sends every model to ``default_url``: the fleet of one broker.
    """

    def __init__(self, entries: Sequence[Route], default_url: str) -> None:
        self.entries = tuple(entries)
        self.default_url = default_url
        self._chosen: dict[str, str] = {}

    @classmethod
    def parse(cls, text: str, default_url: str) -> Routes:
        """The table ``text`` (inline or ``@file.json``) names; ValueError naming the entry and
        the rule it breaks."""
        return cls(parse_routes(text), default_url)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def url_for(self, model: str) -> str:
        """The broker URL of ``model``."""
        url = self._chosen.get(model)
        if url is None:
            url = next((r.url for r in self.entries if r.matches(model)), self.default_url)
            if len(self._chosen) < 10_000:  # a bound on names a caller may make up
                self._chosen[model] = url
        return url

    def urls(self) -> list[str]:
        """Every distinct broker URL of the table, the default's first."""
        return list(dict.fromkeys([self.default_url, *(r.url for r in self.entries)]))

    def by_url(self, models: Iterable[str]) -> dict[str, list[str]]:
        """``models`` grouped by their broker URL (in the order first met)."""
        groups: dict[str, list[str]] = {}
        for model in models:
            groups.setdefault(self.url_for(model), []).append(model)
        return groups

    def url_of_models(self, models: Sequence[str]) -> str:
        """The one broker URL of every model of ``models`` (the default for none); ValueError
        naming the models of each URL when they sit on more than one (one worker, one Redis)."""
        groups = self.by_url(models)
        if len(groups) > 1:
            where = "; ".join(f"{', '.join(ms)} on {masked_url(url)}" for url, ms in groups.items())
            raise ValueError(f"the models of one worker must share one broker, but "
                             f"{ROUTES_VARIABLE} routes {where}: start one worker per broker "
                             f"(--models)")
        return next(iter(groups), self.default_url)


def parse_routes(text: str) -> list[Route]:
    """The entries of ``text``: inline, or the JSON file ``@path`` (or a path ending ``.json``)."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("@") or text.endswith(".json"):
        return _from_file(Path(text.removeprefix("@").strip()))
    entries: list[tuple[str, str]] = []
    for number, part in enumerate((p.strip() for p in text.split(";")), start=1):
        if not part:
            continue
        if _URL.match(part) and entries and is_sentinel_url(entries[-1][1]):
            pattern, url = entries[-1]  # the next Sentinel of the previous entry's URL
            entries[-1] = (pattern, f"{url};{part}")
            continue
        pattern, equals, url = part.partition("=")
        if not equals:
            raise ValueError(f"{ROUTES_VARIABLE} entry {number} ({part!r}) has no '=': {_RULE}")
        entries.append((pattern.strip(), url.strip()))
    return [_checked(pattern, url, f"entry {pattern!r}") for pattern, url in entries]


def _from_file(path: Path) -> list[Route]:
    try:
        table = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{ROUTES_VARIABLE}: cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{ROUTES_VARIABLE}: {path} is not JSON ({exc})") from None
    if not isinstance(table, dict):
        raise ValueError(f"{ROUTES_VARIABLE}: {path} must hold one JSON object of pattern → "
                         f"broker URL, e.g. {{\"resnet50\": \"redis://a:6379/0\"}}; got "
                         f"{type(table).__name__}")
    return [_checked(str(pattern), url, f"entry {pattern!r} of {path}")
            for pattern, url in table.items()]


def _checked(pattern: str, url: object, where: str) -> Route:
    """``pattern`` → ``url`` as a route; ValueError naming ``where`` and the rule."""
    if not pattern or not _PATTERN.match(pattern):
        raise ValueError(f"{ROUTES_VARIABLE} {where}: the pattern must be a model name or a glob "
                         f"of one (letters, digits, _ . : - and * ? [ ] !): {_RULE}")
    if not isinstance(url, str) or not _URL.match(url):
        shown = url if not isinstance(url, str) or "@" not in url else "…@" + url.rsplit("@", 1)[1]
        raise ValueError(f"{ROUTES_VARIABLE} {where}: {shown!r} is not a broker URL; a URL looks "
                         f"like {URL_EXAMPLES}")
    if is_sentinel_url(url) and not all(is_sentinel_url(p) for p in url.split(";")):
        raise ValueError(f"{ROUTES_VARIABLE} {where}: every ';' part of a Sentinel URL must be "
                         f"sentinel://host:port")
    return Route(pattern, url)
