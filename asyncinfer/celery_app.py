"""The Celery application: ``celery -A asyncinfer worker -Q infer.identity`` finds it here.

Nothing is read at import. The app is configured explicitly (:func:`configure`, as
``asyncinfer worker`` does with the settings it was given), or else from the ``ASYNCINFER_*``
environment when Celery first reads its configuration (``celery -A asyncinfer ...``, or a process
that just calls ``AsyncResult(id)``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import cached_property
from typing import Any

from celery import Celery

from asyncinfer.config.bound import bind, bind_lazily, settings_of
from asyncinfer.config.celery_config import celery_config
from asyncinfer.config.settings import Settings

__all__ = ["app", "create_app", "configure"]

#: The modules a worker of the app imports: the tasks, and the worker's start-up and signals.
INCLUDE = ["asyncinfer.tasks.infer", "asyncinfer.tasks.stages", "asyncinfer.worker.bootstrap"]


class _App(Celery):  # type: ignore[misc]
    """Celery, with a worker whose banner tells a device worker's truth, publishing json or
    msgpack only on the project's kombu transport (:mod:`asyncinfer.config.celery_amqp`), and a
    result backend that announces a request's final state on its reply channel
    (:mod:`asyncinfer.broker.result_announcements`) and counts Redis' refusals as safe to retry
    (:mod:`asyncinfer.broker.refusals`)."""

    amqp_cls = "asyncinfer.config.celery_amqp:AMQP"

    @cached_property
    def Worker(self) -> Any:  # noqa: N802 - Celery's name
        return self.subclass_with_self("asyncinfer.worker.banner:Worker")

    def _get_backend(self) -> Any:
        """Celery's result backend, announcing final states on reply channels
        (broker/result_announcements.py)."""
        from asyncinfer.broker.refusals import retrying_refusals
        from asyncinfer.broker.result_announcements import announcing

        return announcing(retrying_refusals(super()._get_backend()))


class _FromSettings(Mapping[str, Any]):
    """The Celery configuration of an app's settings, computed when Celery first reads it."""

    def __init__(self, app: Celery) -> None:
        self._app = app
        self._config: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        if self._config is None:
            self._config = celery_config(settings_of(self._app) or Settings.from_env())
        return self._config

    def __getitem__(self, key: str) -> Any:
        return self._load()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


def create_app(settings: Settings | None = None, include: list[str] | None = None) -> Celery:
    """A Celery app configured from ``settings`` (default: the ``ASYNCINFER_*`` environment, read
    when first needed)."""
    celery = _App("asyncinfer", set_as_current=False, include=include)
    if settings is None:
        bind_lazily(celery, Settings.from_env)
    else:
        bind(celery, settings)
    celery.config_from_object(_FromSettings(celery))
    # On a Redis broker a device worker's infer.* queues go to the fast consumer.
    celery.steps["worker"].add("asyncinfer.worker.step:FastConsumerStep")
    return celery


def configure(celery: Celery, settings: Settings) -> None:
    """Configure ``celery`` from ``settings`` from now on (before its worker starts)."""
    bind(celery, settings)
    celery.config_from_object(_FromSettings(celery), force=True)


app = create_app(include=INCLUDE)
app.set_current()
