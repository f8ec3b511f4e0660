"""A request's reply channel: where its final result is announced besides its own result channel.

Celery's Redis backend publishes a result on a channel named after its key, so a waiter must
SUBSCRIBE and UNSUBSCRIBE once per request: three pub/sub replies parsed per request. A producer
that waits on many requests (the Python client, the gateway) names one channel of its own in each
request's ``asyncinfer_reply_to`` header instead, subscribes to it once, and every worker that
stores the request's final state (SUCCESS, FAILURE, REVOKED) publishes the same stored payload
there too. The result key and its channel are written as before, so ``AsyncResult(id).get()`` and
any other waiter work unchanged.

A worker announces a batch's results once per reply channel: a channel that several results of
one batch go to gets one message, :data:`GROUPED` followed by each stored payload as its length in
decimal digits, ``:`` and the payload (:func:`announced_payloads` splits it); a lone result is
its stored payload as it is. A stored payload (a JSON object, a msgpack map) never begins with
:data:`GROUPED`.

The header is optional. When present it must be a string naming a channel under
``asyncinfer:reply:`` (keys.REPLY_CHANNEL_PREFIX) of at most ``MAX_REPLY_CHANNEL_CHARS`` printable
characters; anything else is refused with the request, so a request cannot make a worker publish
on another channel (a result channel, a Celery event channel).
"""

from __future__ import annotations

from typing import Any

from asyncinfer.wire.keys import REPLY_CHANNEL_PREFIX

__all__ = ["GROUPED", "MAX_REPLY_CHANNEL_CHARS", "REPLY_TO", "announced_payloads",
           "reply_rule_broken", "reply_channel_of"]

#: The message header naming the request's reply channel.
REPLY_TO = "asyncinfer_reply_to"
#: What a reply-channel message carrying several results begins with (ASCII record separator;
#: broker/scripts/store.lua writes it as '\30').
GROUPED = b"\x1e"
#: Longest reply channel name accepted.
MAX_REPLY_CHANNEL_CHARS = 200


def reply_rule_broken(value: Any) -> str | None:
    """Why ``value`` (the header's value; None when absent) is not a reply channel; None if it
    is one or the header is absent."""
    if value is None:
        return None
    if not isinstance(value, str):
        return f"header {REPLY_TO!r} must be a string, not {type(value).__name__}"
    if (not value.startswith(REPLY_CHANNEL_PREFIX) or len(value) > MAX_REPLY_CHANNEL_CHARS
            or len(value) == len(REPLY_CHANNEL_PREFIX)
            # every whitespace character but the space is unprintable (checked for all of Unicode)
            or not value.isprintable() or " " in value):
        return (f"header {REPLY_TO!r} must name a channel '{REPLY_CHANNEL_PREFIX}<name>' of at most "
                f"{MAX_REPLY_CHANNEL_CHARS} printable characters without whitespace, not "
                f"{value[:80]!r}")
    return None


def reply_channel_of(headers: Any) -> str | None:
    """The valid reply channel named by a message's ``headers`` (a dict, or Celery's request
    context), or None."""
    value = headers.get(REPLY_TO) if isinstance(headers, dict) else getattr(headers, REPLY_TO, None)
    if value is None or reply_rule_broken(value) is not None:
        return None
    return str(value)


def announced_payloads(message: bytes) -> list[bytes]:
    """The stored payloads a reply-channel ``message`` carries: itself, or each of a grouped
    one's. A grouped message cut short or malformed yields the payloads before the fault."""
    if not message.startswith(GROUPED):
        return [message]
    payloads, at = [], len(GROUPED)
    while at < len(message):
        colon = message.find(b":", at, at + 12)
        if colon < 0 or not message[at:colon].isdigit():
            break
        end = colon + 1 + int(message[at:colon])
        if end > len(message):
            break
        payloads.append(message[colon + 1:end])
        at = end
    return payloads
