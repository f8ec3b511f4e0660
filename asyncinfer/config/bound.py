"""The settings a Celery app was built from, kept on the app (``app.asyncinfer_settings``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncinfer.config.settings import Settings

__all__ = ["bind", "bind_lazily", "settings_of"]

_SETTINGS = "asyncinfer_settings"
_PENDING = "asyncinfer_settings_load"


def bind(app: Any, settings: Settings) -> None:
    """Record that ``app`` is configured from ``settings``."""
    setattr(app, _PENDING, None)
    setattr(app, _SETTINGS, settings)


def bind_lazily(app: Any, load: Callable[[], Settings]) -> None:
    """Record that ``app`` is configured from what ``load()`` returns when first asked."""
    setattr(app, _SETTINGS, None)
    setattr(app, _PENDING, load)


def settings_of(app: Any) -> Settings | None:
    """The settings ``app`` is configured from (None for an app asyncinfer did not build)."""
    settings: Settings | None = getattr(app, _SETTINGS, None)
    if settings is None:
        load = getattr(app, _PENDING, None)
        if load is not None:
            settings = load()
            setattr(app, _PENDING, None)
            setattr(app, _SETTINGS, settings)
    return settings
