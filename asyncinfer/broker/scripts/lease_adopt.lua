-- Take again what Redis forgot a holder held (asyncinfer/broker/leases.py).
-- KEYS: leases, holders, unacked. ARGV: lease (s), holder, the prefix of the reclaimed marks,
-- then per message: its tag, the list it came from, kombu's unacked entry.
-- Records the lease, the holder and the unacked entry (as the take does) of each message that
-- still has no holder and never went back to its queue. Returns the tags recorded.

local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
local adopted = {}
for i = 4, #ARGV, 3 do
  local tag, list, entry = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if redis.call('HEXISTS', KEYS[2], tag) == 0 and redis.call('EXISTS', ARGV[3] .. tag) == 0 then
    redis.call('HSET', KEYS[2], tag, ARGV[2] .. '\t' .. list)
    redis.call('ZADD', KEYS[1], expiry, tag)
    redis.call('HSET', KEYS[3], tag, entry)
    adopted[#adopted + 1] = tag
  end
end
return adopted
