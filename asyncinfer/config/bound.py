"""The settings a Celery app was built from, kept beside the app rather than on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

from asyncinfer.config.settings import Settings

__all__ = ["bind", "bind_lazily", "settings_of"]

_settings: WeakKeyDictionary[Any, Settings] = WeakKeyDictionary()
_pending: WeakKeyDictionary[Any, Callable[[], Settings]] = WeakKeyDictionary()


def bind(app: Any, settings: Settings) -> None:
    """Record that ``app`` is configured from ``settings``."""
    _pending.pop(app, None)
    _settings[app] = settings


def bind_lazily(app: Any, load: Callable[[], Settings]) -> None:
    """Record that ``app`` is configured from what ``load()`` returns when first asked."""
    _settings.pop(app, None)
    _pending[app] = load


def settings_of(app: Any) -> Settings | None:
    """The settings ``app`` is configured from (None for an app asyncinfer did not build)."""
    try:
        settings = _settings.get(app)
        if settings is None and app in _pending:
            settings = _pending.pop(app)()
            _settings[app] = settings
        return settings
    except TypeError:  # not weakly referable
        return None
