-- Write a model's cached answers (asyncinfer/broker/response_cache.py, as EVAL).
-- Store answers of one model and keep its bound. KEYS: the model's index, then each entry.
-- ARGV: TTL (ms), max entries, now (ms), then each entry's template.

local ttl, bound, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 2, #KEYS do
  redis.call('SET', KEYS[i], ARGV[i + 2], 'PX', ttl)
  redis.call('ZADD', KEYS[1], now, KEYS[i])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
local excess = redis.call('ZCARD', KEYS[1]) - bound
if excess > 0 then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, excess - 1)
  for _, key in ipairs(oldest) do redis.call('DEL', key) end
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, excess - 1)
end
redis.call('PEXPIRE', KEYS[1], ttl)
return excess
