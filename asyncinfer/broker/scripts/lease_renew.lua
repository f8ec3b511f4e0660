-- Renew a holder's leases (asyncinfer/broker/leases.py).
-- KEYS: leases, holders, unacked_index. ARGV: lease (s), holder, the host's time now, then tags.
-- Renews the lease of each tag this holder still holds (and its kombu time); returns the others.

local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
local mine = ARGV[2] .. '\t'
local lost = {}
for i = 4, #ARGV do
  local tag = ARGV[i]
  local h = redis.call('HGET', KEYS[2], tag)
  if h and string.sub(h, 1, #mine) == mine then
    redis.call('ZADD', KEYS[1], expiry, tag)
    redis.call('ZADD', KEYS[3], 'XX', ARGV[3], tag)
  else
    lost[#lost + 1] = tag
  end
end
return lost
