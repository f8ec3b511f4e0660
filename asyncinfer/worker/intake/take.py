"""Taking waiting messages and recording them as unacknowledged in one atomic step.

A BRPOP (kombu's way) hands a message over before the worker has recorded it in kombu's
``unacked`` bookkeeping: a worker killed in between loses that message. The fast consumer takes
messages only with this script: Redis pops up to ``room`` messages (lists in kombu's priority
order) and records each in ``unacked`` / ``unacked_index`` in the same atomic step, so every
message is at all times either on its queue or in the bookkeeping from which kombu restores it. An
idle consumer waits without popping (wake.py), then takes with this script.

Only a well-formed envelope is recorded: one whose JSON, apart from its (base64) body, decodes
to an object with ``properties`` (an object with a string ``delivery_tag``), ``headers`` (an
object, if present), and no deeper nesting than :data:`MAX_ENVELOPE_DEPTH`. Anything else is
popped but not recorded — the consumer answers it as malformed — so kombu's restore sweep (which
every worker runs over ``unacked``) never meets a message it cannot load. The ``unacked`` entry is
kombu's ``[envelope, exchange, routing_key]``, the envelope kept byte for byte.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from asyncinfer.keys import UNACKED_INDEX_KEY, UNACKED_KEY

__all__ = ["Taker", "MAX_ENVELOPE_DEPTH"]

#: Deepest nesting of objects and lists an envelope (outside its body) may have.
MAX_ENVELOPE_DEPTH = 16

# KEYS: unacked_index, unacked, then the lists to take from, in order.
# ARGV: most messages to take, now (seconds), deepest nesting allowed.
# Returns a flat list: list name, message, 1 if recorded (else 0), list name, message, ...
_TAKE = r"""
local max_depth = tonumber(ARGV[3])

local function too_deep(value, depth)
  if type(value) ~= 'table' then return false end
  if depth > max_depth then return true end
  for _, v in pairs(value) do
    if too_deep(v, depth + 1) then return true end
  end
  return false
end

-- The envelope without its body: a base64 body has no quotes or backslashes, so cut it out
-- rather than decode megabytes of it; any other body is decoded with the rest.
local function envelope_of(msg)
  local s, e = string.find(msg, '"body"%s*:%s*"')
  local head = msg
  if s then
    local close = string.find(msg, '"', e + 1, true)
    if close and string.byte(msg, close - 1) ~= 92 then
      head = string.sub(msg, 1, e) .. string.sub(msg, close)
    end
  end
  local ok, env = pcall(cjson.decode, head)
  if not ok or type(env) ~= 'table' then return nil end
  local props = env['properties']
  if type(props) ~= 'table' or type(props['delivery_tag']) ~= 'string'
     or props['delivery_tag'] == '' then return nil end
  local headers = env['headers']
  if headers ~= nil and headers ~= cjson.null
     and (type(headers) ~= 'table' or headers[1] ~= nil) then return nil end  -- an object
  if too_deep(env, 1) then return nil end
  return env
end

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
    local env = envelope_of(msg)
    local recorded = 0
    if env then
      local props = env['properties']
      local info = props['delivery_info']
      local exchange, routing_key = '', queue
      if type(info) == 'table' then
        if type(info['exchange']) == 'string' then exchange = info['exchange'] end
        if type(info['routing_key']) == 'string' then routing_key = info['routing_key'] end
      end
      local tag = props['delivery_tag']
      redis.call('ZADD', KEYS[1], ARGV[2], tag)
      redis.call('HSET', KEYS[2], tag,
                 '[' .. msg .. ', ' .. cjson.encode(exchange) .. ', ' .. cjson.encode(routing_key) .. ']')
      recorded = 1
    end
    taken = taken + 1
    out[#out + 1] = KEYS[i]
    out[#out + 1] = msg
    out[#out + 1] = recorded
  end
  if taken >= room then break end
end
return out
"""


class Taker:
    """Runs the take script on the broker ``client``."""

    def __init__(self, client: Any) -> None:
        self._take = client.register_script(_TAKE)

    def take(self, lists: Sequence[str], room: int) -> list[tuple[str, bytes, bool]]:
        """Up to ``room`` messages from ``lists`` (in order): ``(list name, message, recorded)``,
        oldest first per list; ``recorded`` is False for a malformed message (popped, not recorded
        as unacknowledged)."""
        if room <= 0:
            return []
        flat = self._take(keys=[UNACKED_INDEX_KEY, UNACKED_KEY, *lists],
                          args=[room, time.time(), MAX_ENVELOPE_DEPTH])
        taken = []
        for i in range(0, len(flat), 3):
            key = flat[i]
            taken.append((key.decode() if isinstance(key, bytes) else str(key), flat[i + 1],
                          bool(flat[i + 2])))
        return taken
