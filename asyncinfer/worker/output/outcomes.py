"""How each request the fast consumer took ends: the outcome it hands to the result writer.

Every ending goes through here — success, failure, revocation, a retry, an acknowledgement of a
request answered before — and is announced once through the worker's
:class:`~asyncinfer.worker.lifecycle.Settlement` (log line, metrics, events). A retry is decided
here too: the task's retry options when it fails, the fleet's retry budget just before the write
(one round trip per written batch, on the writer's thread, so the device never waits on Redis).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

from celery import states
from celery.exceptions import TaskRevokedError

from asyncinfer.constants import TASK_NAME
from asyncinfer.errors import ModelError, RequestExpired, RequestRevoked
from asyncinfer.wire.envelope import printable
from asyncinfer.wire.messages import retry_message
from asyncinfer.wire.protocol import Request
from asyncinfer.worker.celery_errors import as_celery
from asyncinfer.worker.lifecycle import Settlement
from asyncinfer.worker.output.outcome import Outcome
from asyncinfer.worker.output.shard_writers import ShardWriters
from asyncinfer.worker.requests.holdings import Holdings
from asyncinfer.worker.requests.taken import TakenMessage

__all__ = ["Outcomes", "model_of"]

log = logging.getLogger(__name__)


def model_of(d: TakenMessage) -> str:
    """The model a message is for, by its queue (the queue's name when it is no ``infer.*``)."""
    return d.model or d.queue


class Outcomes:
    """Outcomes of one consumer's requests, from the model's future to the writer."""

    def __init__(self, writer: ShardWriters, settlement: Settlement, holdings: Holdings,
                 response: Any) -> None:
        self.writer = writer
        self.settlement = settlement
        self.holdings = holdings
        #: ``response(request, completed, hostname)``: the v2 response of a finished request.
        self.response = response

    def succeed(self, d: TakenMessage, response: Any, embed: dict[str, Any] | None) -> None:
        self.settlement.succeeded(d, model_of(d), response)
        self.writer.put(Outcome(d, states.SUCCESS, response, embed))

    def revoke(self, d: TakenMessage, expired: bool, embed: dict[str, Any] | None = None,
               reason: str | None = None) -> None:
        """``d`` was revoked (or ``expired``) before it ran; ``reason`` says where."""
        self.settlement.revoked(d, model_of(d), expired)
        error = TaskRevokedError(reason or ("expired" if expired else "revoked"))
        self.writer.put(Outcome(d, states.REVOKED, error, embed))

    def fail(self, d: TakenMessage, exc: BaseException, embed: dict[str, Any] | None = None,
             retry: bool = True) -> None:
        """``d`` failed with ``exc``: retried when the task's options say so, else FAILURE."""
        if retry and self._retry(d, exc, embed):
            return
        self.settlement.failed(d, model_of(d), exc)
        self.writer.put(Outcome(d, states.FAILURE, exc, embed))

    def acknowledge(self, d: TakenMessage, state: str = states.FAILURE) -> None:
        """Acknowledge ``d`` without storing a result (nothing to answer, or answered before)."""
        self.writer.put(Outcome(d, state, None, store=False))

    def _retry(self, d: TakenMessage, exc: BaseException, embed: dict[str, Any] | None) -> bool:
        if not (d.tag and d.headers.get("task") == TASK_NAME):
            return False
        retries = int(d.headers.get("retries") or 0)
        countdown_s = self.settlement.policy.retries.countdown_s(exc, retries)
        if countdown_s is None:
            return False
        self.writer.put(Outcome(d, states.RETRY, exc, embed, retry=retry_message(d, countdown_s)))
        return True

    def settle(self, d: TakenMessage, request: Request, future: Future[Any],
               embed: dict[str, Any] | None) -> None:
        """Settle ``d`` once its future is done (a done-callback: nothing may escape it, or the
        request would stay in flight unanswered). One given up meanwhile (its lease went to
        another worker, which runs it) is not answered here."""
        if not self.holdings.holds(d):
            return
        try:
            self._settle(d, request, future, embed)
        except Exception as exc:  # noqa: BLE001 - the last resort: answer it all the same
            log.exception("request %s: settling it failed", printable(d.request_id))
            self.settlement.failed(d, model_of(d), exc)
            self.writer.put(Outcome(d, states.FAILURE, ModelError(
                f"request {d.request_id}: the worker could not settle it ({type(exc).__name__}: "
                f"{exc})")))

    def _settle(self, d: TakenMessage, request: Request, future: Future[Any],
                embed: dict[str, Any] | None) -> None:
        exc = future.exception()
        if exc is not None:
            if isinstance(exc, RequestRevoked):
                self.revoke(d, isinstance(exc, RequestExpired), embed, reason=str(exc))
            else:
                self.fail(d, as_celery(exc), embed)
            return
        try:
            done = future.result()
            d.batch = getattr(done, "batch", None)  # its device batch, for tracing (None: off)
            response = self.response(request, done, self.settlement.hostname)
        except Exception as err:  # noqa: BLE001
            self.fail(d, err, embed)
            return
        self.succeed(d, response, embed)

    def before_write(self, batch: list[Outcome]) -> None:
        """(The writer's, before each write.) Ask the fleet's retry budget for the retries in
        ``batch``: those granted are announced, those refused fail now (their one failure line,
        their metric)."""
        retries = [o for o in batch if o.state == states.RETRY]
        if not retries:
            return
        refusals = self.settlement.policy.retries.refused([o.delivery.request_id for o in retries],
                                                 [o.result for o in retries])
        for outcome, refusal in zip(retries, refusals, strict=True):
            d = outcome.delivery
            if refusal is None:
                self.settlement.retrying(d, model_of(d), outcome.result,
                                         int(d.headers.get("retries") or 0))
            else:
                outcome.state, outcome.result, outcome.retry = states.FAILURE, refusal, None
                self.settlement.failed(d, model_of(d), refusal)

    def written(self, batch: list[Outcome]) -> None:
        """(The writer's, after each write.) ``batch`` is stored and acknowledged: no longer
        held; its events go out."""
        self.holdings.release([o.delivery for o in batch])
        if self.settlement.events is not None:
            self.settlement.events.flush()  # after the results are stored, as Celery's worker does
