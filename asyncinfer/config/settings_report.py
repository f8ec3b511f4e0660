"""The settings told to people: where each one's value comes from (``asyncinfer config``) and
the Markdown table of every variable, its default and meaning (docs/configuration.md,
``asyncinfer config --table``), read from :class:`~asyncinfer.config.settings.Settings`' fields."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from asyncinfer.config.settings import Settings

__all__ = ["setting_sources", "settings_table"]


def setting_sources(environ: Mapping[str, str] | None = None, **overrides: Any) -> dict[str, str]:
    """Where each setting of ``Settings.from_env(environ, **overrides)`` comes from: ``flag``,
    ``environment (VAR)`` or ``default``."""
    env = os.environ if environ is None else environ
    sources = {}
    for f in dataclasses.fields(Settings):
        var = f.metadata["env"]
        if overrides.get(f.name) is not None:
            sources[f.name] = "flag"
        elif env.get(var):
            sources[f.name] = f"environment ({var})"
        else:
            sources[f.name] = "default"
    return sources


def settings_table() -> str:
    """The Markdown table of every environment variable, its default and meaning."""
    lines = ["| Variable | Default | Meaning |", "|---|---|---|"]
    for f in dataclasses.fields(Settings):
        default = f.default
        shown = ",".join(default) if isinstance(default, tuple) else str(default)
        shown = shown.lower() if isinstance(default, bool) else shown
        shown = f"`{shown}`" if shown else "(unset)"
        lines.append(f"| `{f.metadata['env']}` | {shown} | {f.metadata['doc']} |")
    return "\n".join(lines)
