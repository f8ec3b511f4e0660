"""A request's admission before it runs and its settlement after, as the pipeline asks them.

**Admission** (:func:`admit`): a request taken from its queue is delayed until its ``eta``
(a retry's backoff), refused when it is not ``asyncinfer.infer``, revoked when revoked or past its
``expires``, answered without running when a redelivered copy already has a final result stored
(:func:`answered_before`), and otherwise run — the policies' rules, asked in their order.

**Settlement** (:class:`Settlement`): how a request ended is announced once: the one failure log
line, the metrics (success, failure by reason, revoked, retries), the task events (Flower), while
the retry decision is the policy's (:class:`~asyncinfer.policy.retries.Retries`: the task's retry
options within the fleet's retry budget).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery import states
from celery.worker import state as worker_state

from asyncinfer.constants import TASK_NAME
from asyncinfer.policy.admission import Admission
from asyncinfer.policy.expiry import Expiry, is_revoked
from asyncinfer.policy.policy import Policy
from asyncinfer.policy.task_policy import allow_infer_only
from asyncinfer.wire.envelope import printable
from asyncinfer.wire.result_json import decode_meta
from asyncinfer.worker.metrics import WorkerMetrics

__all__ = ["admit", "already_answered", "answered_before", "count_started", "Settlement",
           "FAILED_FORMAT"]

log = logging.getLogger(__name__)

#: The one log line of a failed request (WARNING): request ID, model, worker, exception class and
#: message. Both request paths log it once per failure, and nothing else logs that failure.
FAILED_FORMAT = "request %s failed: model=%s worker=%s reason=%s: %s"

def admit(request_id: str, task: Any, queue: str, *, eta: Any = None, expires: Any = None,
          revoked: Callable[[str], bool] = is_revoked, expiry: Expiry | None = None) -> Admission:
    """The admission of one request by the policies both consumers share, in their order: its
    ``eta`` (only when it has not been waited for yet: policy/expiry.py), the allow-list of an
    ``infer.*`` queue (policy/task_policy.py), revocation and ``expires`` (policy/expiry.py).
    ``expiry``: the worker's (its policy's), else one asking ``revoked``."""
    expiry = expiry or Expiry(revoked)
    return (expiry.delay(eta) or allow_infer_only(request_id, task, queue)
            or expiry.judge(request_id, expires))


def count_started(n: int = 1) -> None:
    """Count ``n`` started requests in Celery's ``inspect stats`` totals."""
    worker_state.total_count[TASK_NAME] += n
    worker_state.all_total_count[0] += n


def already_answered(status: Any) -> bool:
    """Whether a stored result of this ``status`` answers a redelivered copy of its request (a
    worker died between storing the result and the acknowledgement): run it again only if not."""
    return status in states.READY_STATES


def answered_before(backend: Any, request_ids: list[str], client: Any = None) -> dict[str, str]:
    """The redelivered requests among ``request_ids`` whose final result is already stored (a
    worker died between storing it and the acknowledgement), with that result's state: they are
    acknowledged without running again. One MGET on ``client`` (the results' Redis; default the
    backend's). When Redis cannot tell, none (they run again: at least once)."""
    if not request_ids:
        return {}
    client = client if client is not None else getattr(backend, "client", None)
    try:
        if client is None:  # a result backend other than Redis
            metas = [backend.get_task_meta(i, cache=False) for i in request_ids]
        else:
            raws = client.mget([backend.get_key_for_task(i) for i in request_ids])
            metas = [_meta(backend, raw) for raw in raws]
    except Exception as exc:  # noqa: BLE001 - cannot tell: run them again
        log.warning("could not look up %d redelivered requests (%s); running them",
                    len(request_ids), exc)
        return {}
    answered = {}
    for request_id, meta in zip(request_ids, metas, strict=True):
        status = meta.get("status")
        if already_answered(status):
            log.info("request %s was redelivered but its result (%s) is already stored; "
                     "acknowledged without running it again", request_id, status)
            answered[request_id] = str(status)
    return answered


def _meta(backend: Any, raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    try:
        return decode_meta(backend, raw)
    except Exception:  # noqa: BLE001 - unreadable: run it again
        return {}


class Settlement:
    """How requests end on one worker, announced once (see the module documentation).

    ``events``: the worker's :class:`~asyncinfer.worker.events.TaskEvents` when it sends task
    events itself (the fast consumer), else None; ``metrics``: the worker's.
    """

    def __init__(self, hostname: str, device: str, policy: Policy, events: Any = None,
                 metrics: WorkerMetrics | None = None) -> None:
        self.hostname = hostname
        self.device = device
        self.policy = policy
        self.events = events
        self.metrics = metrics or WorkerMetrics()

    def succeeded(self, request: Any, model: str, response: Any) -> None:
        self.metrics.record_outcome(model, self.device, states.SUCCESS)
        if self.events is not None:
            self.events.finished(request, states.SUCCESS, response)

    def failed(self, request: Any, model: str, exc: BaseException, worker: str | None = None) -> None:
        """The request ended in FAILURE: its one log line, its metric, its event."""
        log.warning(FAILED_FORMAT, printable(_id_of(request)), model, worker or self.hostname,
                    type(exc).__name__, printable(exc, 1000))
        taken_at = getattr(request, "received_at", 0.0)  # a taken message's take
        self.metrics.record_outcome(model, self.device, states.FAILURE, exc,
                                    time.perf_counter() - taken_at if taken_at else 0.0)
        if self.events is not None:
            self.events.finished(request, states.FAILURE, exc)

    def revoked(self, request: Any, model: str, expired: bool) -> None:
        self.metrics.record_outcome(model, self.device, states.REVOKED)
        if self.events is not None:
            self.events.finished(request, states.REVOKED, None, expired=expired)

    def retrying(self, request: Any, model: str, exc: BaseException, retries: int) -> None:
        """The request goes back to its queue for retry number ``retries + 1``."""
        log.info("request %s: retry %s after %s: %s", printable(_id_of(request)), retries + 1,
                 type(exc).__name__, printable(exc, 1000))
        self.metrics.count_retry(model, self.device)
        if self.events is not None:
            self.events.finished(request, states.RETRY, exc)


def _id_of(request: Any) -> str:
    return str(getattr(request, "request_id", None) or getattr(request, "id", None) or "?")
