"""A Celery producer's request claims its task ID, as the ``Client``'s does.

``app.send_task("asyncinfer.infer", kwargs=..., task_id="7")`` (or ``apply_async``) from any
producer of the app on a Redis broker publishes through the project's kombu transport
(broker/transport.py), which hands an ``asyncinfer.infer`` message here instead of kombu's LPUSH: the
publish script of the ``Client`` (broker/publisher.py) claims the ID with the request's identity
(wire/request_identity.py) and pushes it, in the one round trip kombu's LPUSH was. So the same
task ID sent again as the same request is not pushed again (one run, one answer: its
``AsyncResult``), and sent as another request (another model, version, inputs or parameters)
``send_task`` raises :class:`~asyncinfer.errors.RequestIdReused` naming the ID and what differs.

Only a first send claims: a message with ``retries`` above 0 is Celery's own retry of the request
(``Task.retry`` on a stock worker), which must go on its queue again under the same ID. A message
whose body cannot be read is pushed as kombu would (the worker refuses it, naming the rule).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncinfer.broker.publisher import Publisher, script_arguments
from asyncinfer.constants import TASK_NAME
from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.envelope import Message, decode_body
from asyncinfer.wire.request_identity import identity

__all__ = ["CeleryClaims", "claims_message", "claims_on"]


def claims_message(message: Mapping[str, Any]) -> bool:
    """Whether kombu's ``message`` is a first send of an ``asyncinfer.infer`` request."""
    headers = message.get("headers")
    return (isinstance(headers, Mapping) and headers.get("task") == TASK_NAME
            and not headers.get("retries") and isinstance(headers.get("id"), str))


def claims_on(channel: Any, queue: str, message: Mapping[str, Any]) -> bool:
    """Whether kombu's Redis ``channel`` publishes ``message`` on ``queue`` through the claim:
    a first send of an ``asyncinfer.infer`` request (:func:`claims_message`), on a queue kombu
    does not expire after each push (``x-expires``: the queues of the remote control's replies),
    with no global key prefix. Another queue's expiry is no reason: a producer whose app had run
    ``control.inspect()`` (its reply queue expires) published every later request unclaimed."""
    expiring = getattr(channel, "_expires", None) or {}
    return (claims_message(message) and queue not in expiring
            and not getattr(channel, "global_keyprefix", None))


class CeleryClaims:
    """Publishes ``asyncinfer.infer`` messages of a kombu channel on Redis ``client``, each
    claiming its task ID for ``claim_ttl_s`` (the result expiry)."""

    def __init__(self, client: Any, claim_ttl_s: float) -> None:
        self.publisher = Publisher(client, claim_ttl_s=claim_ttl_s)

    def put(self, client: Any, queue: str, message: Mapping[str, Any], text: str,
            priority: int) -> bool:
        """Claim and push ``message`` (``text``: it as kombu's JSON) on ``queue`` at ``priority``
        through ``client`` (a connection of the channel); False when its body cannot be read
        (the caller pushes it as kombu does). Raises RequestIdReused when its task ID was sent
        before as another request."""
        request_id = message["headers"]["id"]
        try:
            _, kwargs, _ = decode_body(Message(b"", queue, envelope=dict(message),
                                               request_id=request_id))
        except InvalidRequest:
            return False
        push = self.publisher.prepare(queue, request_id, text, claim=True, priority=priority,
                                      identity=identity(queue, kwargs))
        keys, args = script_arguments([push])
        reply = self.publisher._publish(keys=keys, args=args, client=client)
        push.status(reply[:2])  # PUBLISHED or DUPLICATE; raises RequestIdReused
        return True
