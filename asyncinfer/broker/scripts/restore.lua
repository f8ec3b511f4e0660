-- Put a worker's held messages back on their queues at once (asyncinfer/broker/restore.py), as
-- kombu restores an unacknowledged message, and drop their bookkeeping.
-- KEYS: unacked_index, unacked, leases, lease holders, lease device marks. ARGV: the worker's
-- lease holder name, the prefix of the reclaimed marks, the prefix of the death counts, the
-- deaths' lifetime (s), then per message: its tag, the list it goes back on, its text as it goes
-- back, and the request ID to count a death against ('' for none).
-- Only what is still this worker's goes back: a tag leased to another holder now (its lease
-- lapsed here, a sweep put it back and another worker took it), or put back by a sweep and not
-- taken yet (its reclaimed mark), is left alone: pushed again, it would run twice. A tag with no
-- holder and no mark (no leases; or Redis forgot it) goes back. Returns how many went back.

local holder, prefix = ARGV[1], ARGV[1] .. '\t'
local back = 0
for i = 5, #ARGV, 4 do
  local tag, list, text, rid = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local entry = redis.call('HGET', KEYS[4], tag)
  local mine
  if entry then
    mine = entry == holder or string.sub(entry, 1, #prefix) == prefix
  else
    mine = redis.call('EXISTS', ARGV[2] .. tag) == 0
  end
  if mine then
    redis.call('LPUSH', list, text)
    redis.call('ZREM', KEYS[1], tag)
    redis.call('HDEL', KEYS[2], tag)
    redis.call('ZREM', KEYS[3], tag)
    redis.call('HDEL', KEYS[4], tag)
    redis.call('HDEL', KEYS[5], tag)
    if rid ~= '' then
      redis.call('INCR', ARGV[3] .. rid)
      redis.call('EXPIRE', ARGV[3] .. rid, tonumber(ARGV[4]))
    end
    back = back + 1
  end
end
return back
