"""asyncinfer: asynchronous, batched inference on accelerators as a Celery + Redis system.

``celery -A asyncinfer worker -Q infer.identity`` finds the Celery app as ``asyncinfer.app``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["app", "Client", "InferFuture", "InferResponse", "__version__"]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that importing the package stays light (no torch until a worker needs it).
    if name == "app":
        from asyncinfer.celery_app import app

        return app
    if name in ("Client", "InferFuture", "InferResponse"):
        import asyncinfer.client as client

        return getattr(client, name)
    raise AttributeError(f"module 'asyncinfer' has no attribute {name!r}")
