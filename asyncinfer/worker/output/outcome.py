"""How one request ended, as the result writer stores it (result_writer.py): its state, its result
(a response, or an exception), its retry message, and its dead letter when it failed for good."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery import Celery, states

from asyncinfer.worker import dead_letters
from asyncinfer.worker.requests.taken import TakenMessage

__all__ = ["Outcome", "add_dead_letter"]


@dataclass
class Outcome:
    """How one request ended: a state and its result (a response, or an exception)."""

    delivery: TakenMessage
    state: str
    result: Any
    embed: dict[str, Any] | None = None
    #: For state RETRY: the message that retries the request (:func:`retry_message`).
    retry: str | None = None
    #: False to acknowledge only (the result is already stored: a redelivered duplicate).
    store: bool = True
    #: Set by the writer: a sequence request's result left out, as its request already had a
    #: final state (store.py's guard); the state it left is taken back (engine/sequences.py).
    superseded: bool = False


def add_dead_letter(pipe: Any, app: Celery, outcome: Outcome, worker: str) -> None:
    """Add the dead letter of ``outcome`` (on ``worker``) to ``pipe`` (the broker's write of that
    outcome) when it is a final FAILURE (stored, not retried) of a model that opted in
    (worker/dead_letters.py). Never raises: a dead letter must not cost a result."""
    if outcome.state == states.FAILURE and outcome.store and outcome.retry is None:
        dead_letters.add_failure(pipe, app, outcome.delivery, outcome.result, worker=worker)
