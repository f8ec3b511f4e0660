"""asyncinfer: asynchronous, batched inference on accelerators as a Celery + Redis system.

``celery -A asyncinfer worker -Q infer.identity`` finds the Celery app as ``asyncinfer.app``.
Importing the package makes that app Celery's default (created on first use, from the settings of
that moment), so ``celery.result.AsyncResult(request_id).get()`` works in any process.
``from asyncinfer import Client`` needs numpy alone and loads no torch: torch loads where tensors
are made or models run (the worker, ``InferResponse.as_torch``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["app", "Client", "InferFuture", "InferResponse", "__version__"]

__version__ = "0.1.0"


def _app() -> Any:
    from asyncinfer.celery_app import app

    return app


def _default_app() -> None:
    """Make the asyncinfer app Celery's default app, lazily: nothing is configured until it is used
    (``asyncinfer worker`` sets its settings first), and a default app already chosen stays."""
    from celery import _state
    from celery.local import Proxy

    if _state.default_app is None:
        _state.set_default_app(Proxy(_app))


_default_app()


def __getattr__(name: str) -> Any:
    # Lazy, so that importing the package stays light (tests/integration/test_client_light.py keeps it so).
    if name == "app":
        return _app()
    if name in ("Client", "InferFuture", "InferResponse"):
        import asyncinfer.client as client

        return getattr(client, name)
    raise AttributeError(f"module 'asyncinfer' has no attribute {name!r}")
