"""One setting of :class:`~asyncinfer.config.settings.Settings`: its field (default, environment
variable, line of documentation) and its value read from the environment's text."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

__all__ = ["parse_value", "setting"]


def setting(default: Any, env: str, doc: str) -> Any:
    """A field of ``default``, read from ``env``, documented by ``doc``."""
    return field(default=default, metadata={"env": env, "doc": doc})


def parse_value(f: dataclasses.Field[Any], raw: str) -> Any:
    """The value of the setting ``f`` that the text ``raw`` says, of its default's type; ValueError
    naming its variable otherwise."""
    kind = type(f.default)
    if kind is bool:
        if raw.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if raw.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{f.metadata['env']} must be true or false, got {raw!r}")
    try:
        if kind is tuple:
            return tuple(part.strip() for part in raw.split(",") if part.strip())
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except ValueError:
        raise ValueError(f"{f.metadata['env']} must be a {kind.__name__}, got {raw!r}") from None
    return raw
