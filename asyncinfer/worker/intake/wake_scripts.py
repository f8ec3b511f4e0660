"""The Redis scripts of the idle wait (wake.py): claiming, renewing, passing on and giving up the
watch of a list, and counting the consumers that wait for a list's bell."""

from __future__ import annotations

__all__ = ["CLAIM", "CLAIM_FREE", "PASS", "RELEASE", "WAITING"]

# KEYS: a list's watch. ARGV: the consumer's token, the watch's lifetime (ms). 1 when this
# consumer watches the list now (it took the watch, or renewed its own), else 0.
CLAIM = r"""
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: the watches of a consumer's lists. ARGV: its token. Deletes each one it holds (a closing
# consumer's: its successor, a restarted worker or the same worker's new queues, claims them at
# once instead of after their lifetime); how many.
RELEASE = r"""
local released = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('DEL', key)
    released = released + 1
  end
end
return released
"""

# KEYS: the first list's watch, then the watches of other lists this consumer does not hold.
# ARGV: the consumer's token, the first watch's lifetime, the others' (ms). The first is claimed
# or renewed as CLAIM does; each other one is taken only if nobody holds it. Per key, 1 when
# this consumer holds it now, else 0.
CLAIM_FREE = r"""
local out = {}
for i, key in ipairs(KEYS) do
  local lifetime = ARGV[3]
  if i == 1 then lifetime = ARGV[2] end
  if redis.call('SET', key, ARGV[1], 'NX', 'PX', lifetime) then
    out[i] = 1
  elseif redis.call('GET', key) == ARGV[1] then
    redis.call('PEXPIRE', key, lifetime)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

# KEYS: bells' counts of waiters. ARGV: +1 or -1. Never below 0; each lapses 30 s after its last
# change (a waiter killed while it waited counts no longer).
WAITING = r"""
for _, key in ipairs(KEYS) do
  local n = redis.call('INCRBY', key, ARGV[1])
  if n < 0 then redis.call('SET', key, 0) end
  redis.call('EXPIRE', key, 30)
end
return 0
"""

# KEYS: a list's watch, bell and count of waiters. ARGV: the consumer's token. A watcher thread
# that fired while its consumer is busy gives the watch up and rings the bell when others wait
# for it (1), else keeps it (0).
PASS = r"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if (tonumber(redis.call('GET', KEYS[3]) or '0') or 0) <= 0 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('LPUSH', KEYS[2], '1')
redis.call('LTRIM', KEYS[2], 0, 0)
redis.call('PEXPIRE', KEYS[2], 60000)
return 1
"""
