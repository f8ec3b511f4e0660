-- Sweep lapsed sequence-worker registrations (asyncinfer/worker/requests/sequence_pins.py).
-- KEYS: the set of models with sequence workers. ARGV: the prefix of their sorted sets, the grace
-- (s) a lapsed registration with an empty list is kept. Returns model, member, ... of the lapsed
-- registrations whose list holds requests; removes those empty past the grace.

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {}
for _, model in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = ARGV[1] .. model
  local lapsed = redis.call('ZRANGEBYSCORE', key, '-inf', '(' .. now, 'WITHSCORES')
  for j = 1, #lapsed, 2 do
    local member, score = lapsed[j], tonumber(lapsed[j + 1])
    local list = string.sub(member, 1, (string.find(member, '\t', 1, true) or 1) - 1)
    if redis.call('LLEN', list) > 0 then
      out[#out + 1] = model
      out[#out + 1] = member
    elseif score < now - tonumber(ARGV[2]) then
      redis.call('ZREM', key, member)
    end
  end
  if redis.call('ZCARD', key) == 0 then
    redis.call('SREM', KEYS[1], model)
    redis.call('DEL', key .. ':turn')
  end
end
return out
