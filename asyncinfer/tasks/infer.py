"""The task every producer sends: ``asyncinfer.infer``, one v2 request in its keyword arguments.

Its retry options are Celery's own (``autoretry_for``, ``max_retries``, ``retry_backoff``,
``retry_backoff_max``, ``retry_jitter``), set from ``ASYNCINFER_*`` settings; Celery's stock
worker applies them, the fast consumer reads them (:mod:`asyncinfer.policy.retries`). Both draw on the
fleet's retry budget in Redis before a retry.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Retry

from asyncinfer.celery_app import app
from asyncinfer.config.bound import settings_of
from asyncinfer.config.settings import Settings
from asyncinfer.constants import TASK_NAME
from asyncinfer.errors import InvalidRequest, RequestRevoked
from asyncinfer.policy.retries import AUTORETRY_FOR
from asyncinfer.wire.envelope import seconds_until
from asyncinfer.wire.protocol import request_kwargs
from asyncinfer.worker.lifecycle import EXPIRED, REVOKED, admit
from asyncinfer.worker.links import send_errbacks
from asyncinfer.worker.stock_path import model_of, settlement
from asyncinfer.worker.worker import worker_of

__all__ = ["infer", "InferTask"]

log = logging.getLogger(__name__)

_settings = settings_of(app) or Settings.from_env()


class InferTask(Task):
    """``asyncinfer.infer``: a retry first asks the fleet's retry budget; errbacks are sent.

    Celery's tracer calls some ``link_error`` callbacks inside the worker (registered tasks that
    take more than one argument: ``celery.map``, ``celery.chunks``, ...), which would let a
    request make a device worker run something other than inference. Here every errback of a
    failed request is sent as a message (called with the request ID, as the fast consumer does)
    for a worker that serves it.
    """

    #: Celery wraps ``run`` with its autoretry unless this is set: the settlement decides instead.
    _orig_run = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        request.asyncinfer_errbacks = request.errbacks  # kept for a retry's message, and sent
        request.errbacks = None  # on failure by on_failure, never called in this process
        # Celery delayed, revoked and expired it already; a revocation may have come since.
        queue = str((request.delivery_info or {}).get("routing_key") or "")
        admission = admit(str(request.id), self.name, queue, expires=request.expires)
        if admission.verdict in (REVOKED, EXPIRED):
            self.backend.mark_as_revoked(str(request.id), reason=admission.verdict, request=request)
            settlement(self.app).revoked(request, model_of(request, args, kwargs),
                                         admission.verdict == EXPIRED)
            raise Ignore()
        try:
            return super().__call__(*args, **kwargs)
        except (Ignore, Retry):
            raise
        except Exception as exc:
            countdown_s = settlement(self.app).policy.retries.countdown_s(exc, int(request.retries or 0))
            if countdown_s is None:
                raise
            raise self.retry(exc=exc, countdown=countdown_s) from exc

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any,
                   einfo: Any) -> None:
        try:
            send_errbacks(self.app, getattr(self.request, "asyncinfer_errbacks", None), task_id,
                          self.request.root_id or task_id)
        except Exception:  # noqa: BLE001 - a broken errback must not hide the failure itself
            log.exception("request %s: sending its errbacks failed", task_id)

    def retry(self, args: Any = None, kwargs: Any = None, exc: Any = None, throw: bool = True,
              eta: Any = None, countdown: Any = None, max_retries: Any = None, **options: Any) -> Any:
        limit = self.max_retries if max_retries is None else max_retries
        if exc is not None and (limit is None or self.request.retries < limit):
            refusal = settlement(self.app).policy.retries.refused([str(self.request.id)], [exc])[0]
            if refusal is not None:
                raise refusal
        request = self.request
        request.errbacks = getattr(request, "asyncinfer_errbacks", None)  # the retry's message
        try:  # carries them on; the failure of this attempt calls none here
            return super().retry(args=args, kwargs=kwargs, exc=exc, throw=throw, eta=eta,
                                 countdown=countdown, max_retries=max_retries, **options)
        finally:
            request.errbacks = None


@app.task(name=TASK_NAME, bind=True, typing=False, base=InferTask,
          autoretry_for=AUTORETRY_FOR, dont_autoretry_for=(InvalidRequest,),
          max_retries=_settings.max_retries, retry_backoff=_settings.retry_backoff_s,
          retry_backoff_max=_settings.retry_backoff_max_s, retry_jitter=_settings.retry_jitter)
def infer(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run one inference request; the task ID is the request ID.

    Keyword arguments are the Open Inference Protocol v2 request: ``model``, ``inputs``,
    ``parameters``. The return value is the v2 response.
    """
    request_id = str(self.request.id)
    if not self.request.retries:
        settlement(self.app).policy.retries.count_first_attempts(1)
    request = request_kwargs(request_id, args, kwargs)
    limits = settlement(self.app).policy.limits_for(self.request.timelimit)
    worker = worker_of(self.app)
    try:
        return worker.runtime.infer(request_id, request, worker=str(self.request.hostname),
                                    expires_in_s=seconds_until(self.request.expires),
                                    time_limits=limits)
    except RequestRevoked as exc:
        # Revoked while it waited in the batcher: record it as Celery would have, store nothing else.
        self.backend.mark_as_revoked(request_id, reason=str(exc), request=self.request)
        raise Ignore() from exc
