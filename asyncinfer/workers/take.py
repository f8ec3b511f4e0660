"""Taking waiting messages and recording them as unacknowledged in one atomic step.

A BRPOP (kombu's way, and the fast consumer's when it waits for work) hands a message over before
the worker has recorded it in kombu's ``unacked`` bookkeeping: a worker killed in between loses
that message. While messages keep coming, the fast consumer takes them with this script instead:
Redis pops up to ``room`` messages (lists in kombu's priority order) and records each in
``unacked`` / ``unacked_index`` in the same atomic step, so every message is at all times either
on its queue or in the bookkeeping from which kombu restores it. An idle worker waits by BRPOP
on the queues' doorbells, which our clients ring with every request (publisher.py), then takes
with this script; only a request from a producer that does not ring (Celery's ``send_task``,
``redis-cli``) comes off its queue with the BRPOP that wakes the worker and is recorded one round
trip later, as kombu records every message.

The ``unacked`` entry is kombu's ``[envelope, exchange, routing_key]``, the envelope kept byte for
byte. A message without a delivery tag (not a kombu envelope) is popped but not recorded; the
consumer answers it as malformed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from asyncinfer.celery_wire import UNACKED_INDEX_KEY, UNACKED_KEY

__all__ = ["Taker"]

# KEYS: unacked_index, unacked, then the lists to take from, in order.
# ARGV: most messages to take, now (seconds).
# Returns a flat list: list name, message, list name, message, ...
_TAKE = r"""
local room = tonumber(ARGV[1])
local out = {}
local taken = 0
for i = 3, #KEYS do
  local queue = KEYS[i]
  local sep = string.find(queue, '\6\22', 1, true)
  if sep then queue = string.sub(queue, 1, sep - 1) end
  while taken < room do
    local msg = redis.call('RPOP', KEYS[i])
    if not msg then break end
    local tag = string.match(msg, '"delivery_tag"%s*:%s*"([^"\\]+)"')
    if tag then
      local exchange = string.match(msg, '"exchange"%s*:%s*"([^"\\]*)"') or ''
      local routing_key = string.match(msg, '"routing_key"%s*:%s*"([^"\\]*)"') or queue
      redis.call('ZADD', KEYS[1], ARGV[2], tag)
      redis.call('HSET', KEYS[2], tag,
                 '[' .. msg .. ', ' .. cjson.encode(exchange) .. ', ' .. cjson.encode(routing_key) .. ']')
    end
    taken = taken + 1
    out[#out + 1] = KEYS[i]
    out[#out + 1] = msg
  end
  if taken >= room then break end
end
return out
"""


class Taker:
    """Runs the take script on the broker ``client``."""

    def __init__(self, client: Any) -> None:
        self._take = client.register_script(_TAKE)

    def take(self, lists: Sequence[str], room: int) -> list[tuple[str, bytes]]:
        """Up to ``room`` messages from ``lists`` (in order), each already recorded as
        unacknowledged: ``(list name, message)`` pairs, oldest first per list."""
        if room <= 0:
            return []
        flat = self._take(keys=[UNACKED_INDEX_KEY, UNACKED_KEY, *lists], args=[room, time.time()])
        pairs = []
        for i in range(0, len(flat), 2):
            key = flat[i]
            pairs.append((key.decode() if isinstance(key, bytes) else str(key), flat[i + 1]))
        return pairs
