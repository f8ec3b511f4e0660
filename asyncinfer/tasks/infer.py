"""The task every producer sends: ``asyncinfer.infer``, one v2 request in its keyword arguments.

A worker never runs it through Celery's request, pool and tracer: Celery's consumer hands each of
its messages to the worker's one pipeline (worker/pipeline.py; the kombu intake on RabbitMQ and
with ``ASYNCINFER_CONSUMER=celery``, the fast consumer on Redis), which admits, batches, settles
and writes it. A worker whose pool forks (prefork) refuses it: the model would run in a child
that owns a device its parent may have touched (worker/celery_consumer.py).

Its retry options are Celery's own (``autoretry_for``, ``max_retries``, ``retry_backoff``,
``retry_backoff_max``, ``retry_jitter``), set from ``ASYNCINFER_*`` settings; the pipeline reads
them (:mod:`asyncinfer.policy.retries`) and draws on the fleet's retry budget before a retry.

Called in this process (``infer.apply()``, ``task_always_eager`` in a user's tests), the body runs
the request on this process's runtime, as a library call: no transport, so no retries.
"""

from __future__ import annotations

from typing import Any

from celery import Task

from asyncinfer.celery_app import app
from asyncinfer.config.bound import settings_of
from asyncinfer.config.settings import Settings
from asyncinfer.constants import TASK_NAME
from asyncinfer.errors import InvalidRequest
from asyncinfer.policy.retries import AUTORETRY_FOR
from asyncinfer.wire.envelope import priority_in, seconds_until
from asyncinfer.wire.protocol import request_kwargs
from asyncinfer.worker.worker import worker_of

__all__ = ["infer"]

_settings = settings_of(app) or Settings.from_env()


@app.task(name=TASK_NAME, bind=True, typing=False, autoretry_for=AUTORETRY_FOR,
          dont_autoretry_for=(InvalidRequest,), max_retries=_settings.max_retries,
          retry_backoff=_settings.retry_backoff_s, retry_backoff_max=_settings.retry_backoff_max_s,
          retry_jitter=_settings.retry_jitter)
def infer(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run one inference request; the task ID is the request ID.

    Keyword arguments are the Open Inference Protocol v2 request: ``model``, ``inputs``,
    ``parameters``. The return value is the v2 response.
    """
    request_id = str(self.request.id)
    worker = worker_of(self.app)
    return worker.runtime.infer(request_id, request_kwargs(request_id, args, kwargs),
                                worker=str(self.request.hostname or worker.name),
                                expires_in_s=seconds_until(self.request.expires),
                                time_limits=worker.policy.limits_for(self.request.timelimit),
                                priority=priority_in(self.request.delivery_info))
