"""The Celery application: ``celery -A asyncinfer worker -Q infer.identity`` finds it here."""

from __future__ import annotations

from celery import Celery

from asyncinfer.config.celery_config import celery_config
from asyncinfer.config.settings import Settings

__all__ = ["app", "create_app"]


def create_app(settings: Settings | None = None) -> Celery:
    """A Celery app configured from ``settings`` (default: the ``ASYNCINFER_*`` environment)."""
    settings = settings or Settings.from_env()
    celery = Celery("asyncinfer", set_as_current=False)
    celery.config_from_object(celery_config(settings))
    celery.asyncinfer_settings = settings  # type: ignore[attr-defined]
    return celery


app = create_app()
app.set_current()
app.conf.include = ["asyncinfer.tasks.infer", "asyncinfer.tasks.stages", "asyncinfer.worker.bootstrap"]
