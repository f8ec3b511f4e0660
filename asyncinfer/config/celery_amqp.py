"""What the asyncinfer app publishes is json or msgpack, whatever a signature asks for.

A request's ``link``, ``link_error`` and chain are signatures written by its producer, options
included; Celery publishes each callback with the serializer its options name. Without this, a
request whose callback says ``"serializer": "pickle"`` would make a worker send a pickle message.
Every task message the app sends (a client's request, a callback, an errback, a chain's next
step, a retry) goes through :meth:`AMQP.send_task_message`, which sends any serializer other than
json and msgpack as the app's own (``ASYNCINFER_TASK_SERIALIZER``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery.app.amqp import AMQP as CeleryAMQP

from asyncinfer.broker.kombu_connection import Connection
from asyncinfer.config.celery_config import ACCEPT_CONTENT

__all__ = ["AMQP"]

log = logging.getLogger(__name__)


class AMQP(CeleryAMQP):  # type: ignore[misc]
    """Celery's AMQP of the app, publishing json or msgpack only; its connections to Redis use the
    project's kombu transport (:mod:`asyncinfer.broker.kombu_connection`)."""

    Connection = Connection

    def _create_task_sender(self) -> Callable[..., Any]:
        send = super()._create_task_sender()
        default = self.app.conf.task_serializer

        def send_task_message(producer: Any, name: str, message: Any, *args: Any,
                              serializer: str | None = None, **kwargs: Any) -> Any:
            if serializer is not None and serializer not in ACCEPT_CONTENT:
                log.info("task %s: sent as %s, not %s (only %s are sent)", name, default,
                         serializer, " and ".join(ACCEPT_CONTENT))
                serializer = default
            return send(producer, name, message, *args, serializer=serializer, **kwargs)

        return send_task_message
