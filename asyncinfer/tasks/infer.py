"""The task every producer sends: ``asyncinfer.infer``, one v2 request in its keyword arguments."""

from __future__ import annotations

from typing import Any

from celery import Task
from celery.exceptions import Ignore

from asyncinfer.celery_app import app
from asyncinfer.celery_wire import seconds_until
from asyncinfer.constants import TASK_NAME
from asyncinfer.errors import RequestRevoked
from asyncinfer.protocol import request_kwargs

__all__ = ["infer"]


@app.task(name=TASK_NAME, bind=True, typing=False)
def infer(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run one inference request; the task ID is the request ID.

    Keyword arguments are the Open Inference Protocol v2 request: ``model``, ``inputs``,
    ``parameters``. The return value is the v2 response.
    """
    from asyncinfer.workers.runtime import get_runtime

    request_id = str(self.request.id)
    request = request_kwargs(request_id, args, kwargs)
    try:
        return get_runtime().infer(request_id, request, worker=str(self.request.hostname),
                                   expires_in_s=seconds_until(self.request.expires))
    except RequestRevoked as exc:
        # Revoked while it waited in the batcher: record it as Celery would have, store nothing else.
        self.backend.mark_as_revoked(request_id, reason=str(exc), request=self.request)
        raise Ignore() from exc
