-- Write a model's cached answers (asyncinfer/broker/response_cache.py, as EVAL).
-- Store answers of one model and keep its bound. KEYS: the model's index, then per entry: its key,
-- its generation key (the token of the weights its requests are answered with now).
-- ARGV: TTL (ms), max entries, now (ms), then per entry: the token of the weights that computed it,
-- its template. An entry whose weights are not its generation's now is not stored (its key would
-- never be looked up: another load or an unload came meanwhile, or it came from other weights).
-- Returns {entries over the bound dropped, entries not stored for their generation}.

local ttl, bound, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local current, stale = {}, 0
for i = 2, #KEYS, 2 do
  local generation = KEYS[i + 1]
  if current[generation] == nil then current[generation] = redis.call('GET', generation) end
  local j = 4 + (i - 2)
  if current[generation] == ARGV[j] then
    redis.call('SET', KEYS[i], ARGV[j + 1], 'PX', ttl)
    redis.call('ZADD', KEYS[1], now, KEYS[i])
  else
    stale = stale + 1
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
local excess = redis.call('ZCARD', KEYS[1]) - bound
if excess > 0 then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, excess - 1)
  for _, key in ipairs(oldest) do redis.call('DEL', key) end
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, excess - 1)
end
redis.call('PEXPIRE', KEYS[1], ttl)
return {math.max(excess, 0), stale}
