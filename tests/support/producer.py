"""A plain Celery producer of the tests: another team's code sending tasks with ``send_task``,
JSON only (nothing of asyncinfer's app)."""

from __future__ import annotations

from celery import Celery

__all__ = ["json_producer"]


def json_producer(url: str, protocol: int = 2) -> Celery:
    """A Celery app on broker and result backend ``url`` that sends and reads JSON only, with
    Celery's task protocol ``protocol``."""
    app = Celery("producer", broker=url, backend=url, set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"], result_accept_content=["json"],
                    result_serializer="json", task_protocol=protocol)
    return app
