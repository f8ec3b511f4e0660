"""A caller-chosen request ID's claim on the result backend's Redis, for requests sent through a
broker that is not Redis (RabbitMQ: ``send_task``): on a Redis broker the publish script claims it
with the push (broker/publisher.py). The claim holds the request's identity
(wire/request_identity.py), so the same request sent again is not sent twice and another request
under the same ID is refused."""

from __future__ import annotations

import logging
from typing import Any

from asyncinfer.broker.scripts import script
from asyncinfer.client.outgoing import Outgoing
from asyncinfer.errors import RequestIdReused
from asyncinfer.wire.keys import CLAIM_PREFIX
from asyncinfer.wire.request_identity import reused_message, same_request

__all__ = ["claim_on_backend", "release_claim"]

log = logging.getLogger(__name__)

_CLAIM = script("claim_request_id")
_RELEASE = script("release_request_id")


def claim_on_backend(client: Any, outgoing: Outgoing, result_key: str, ttl_s: int) -> bool:
    """Claim ``outgoing``'s request ID on the result backend's Redis ``client`` for ``ttl_s``, in
    one round trip (``result_key``: where its result would be); False when it was sent before as
    the same request. Raises RequestIdReused when it was sent with another identity."""
    mine = outgoing.identity()
    stored = client.eval(_CLAIM, 2, CLAIM_PREFIX + outgoing.request_id, result_key, mine, ttl_s)
    if stored is None:
        return True
    stored = stored.decode() if isinstance(stored, bytes) else str(stored)
    if stored and not same_request(mine, stored):
        raise RequestIdReused(reused_message(outgoing.request_id, mine, stored))
    return False


def release_claim(client: Any, outgoing: Outgoing) -> None:
    """The send of a claimed ID failed, not sent: its claim goes (while it is still this
    producer's), so the same request can be submitted again. A failure to release is logged: the
    send's own error is what the caller hears."""
    try:
        client.eval(_RELEASE, 1, CLAIM_PREFIX + outgoing.request_id, outgoing.identity())
    except Exception:  # noqa: BLE001 - the caller hears the send's error
        log.warning("request %s: its ID stays claimed after its send failed (the claim could not "
                    "be released)", outgoing.request_id, exc_info=True)
