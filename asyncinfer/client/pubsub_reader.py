"""Reading published messages that redis-py's hiredis parser already holds, without redis-py's
per-message work: the result watcher's fast path (result_watcher.py)."""

from __future__ import annotations

from typing import Any

import hiredis
from redis._parsers.hiredis import NOT_ENOUGH_DATA as _NOT_ENOUGH_DATA
from redis._parsers.hiredis import _HiredisParser

__all__ = ["buffered_message"]

#: The type of a published message, as hiredis returns it (bytes, or text on a decoding client).
_MESSAGE = (b"message", "message")


def buffered_message(pubsub: Any) -> tuple[Any, Any]:
    """(channel, data) of the next published message already read from the socket and waiting
    in the hiredis reader of ``pubsub``'s connection; (None, None) when none is. It skips what
    redis-py does per message (polls, socket timeouts, and for a RESP3 push a debug line of the
    whole payload made into text). Anything else waiting there (a subscribe confirmation, another
    push) goes where ``get_message`` would send it (the parser's push handling, then
    ``pubsub.handle_message``); an error reply raises, as it would there."""
    connection = pubsub.connection
    parser = getattr(connection, "_parser", None)
    reader = getattr(parser, "_reader", None)
    if reader is None or not isinstance(parser, _HiredisParser):
        return None, None
    while reader.has_data():
        response = reader.gets()
        if response is _NOT_ENOUGH_DATA:
            break  # a message only partly read: the socket has the rest
        if isinstance(response, Exception):
            raise response
        if isinstance(response, list) and len(response) == 3 and response[0] in _MESSAGE:
            return response[1], response[2]
        if isinstance(response, hiredis.PushNotification):
            response = parser.handle_push_response(response)
        if pubsub.is_health_check_response(response):
            pubsub.health_check_response_counter -= 1
        else:
            pubsub.handle_message(response)  # keeps redis-py's record of the subscriptions
    return None, None
