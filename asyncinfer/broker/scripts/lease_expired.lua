-- The expired leases (asyncinfer/broker/leases.py).
-- KEYS: leases, holders, unacked. ARGV: most to return. The expired leases (Redis' clock): tag,
-- holder entry ('' for none), unacked entry ('' for none), tag, ...

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tags = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local out = {}
for _, tag in ipairs(tags) do
  out[#out + 1] = tag
  out[#out + 1] = redis.call('HGET', KEYS[2], tag) or ''
  out[#out + 1] = redis.call('HGET', KEYS[3], tag) or ''
end
return out
