-- A worker announces its models in the catalogue (asyncinfer/broker/catalogue.py, Catalogue.announce).
-- KEYS: the catalogue's live, known, meta and hosts keys (broker/catalogue.py's _KEYS).
-- ARGV: ttl_s, retention_s, then per model: name, member, metadata JSON, host JSON.

if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[1])
local keep = tonumber(ARGV[2])
for i = 3, #ARGV, 4 do
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[i + 1])
  redis.call('ZADD', KEYS[2], now, ARGV[i])
  redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 2])
  redis.call('HSET', KEYS[4], ARGV[i + 1], ARGV[i + 3])
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, m in ipairs(gone) do redis.call('HDEL', KEYS[4], m) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - keep)
for _, m in ipairs(old) do redis.call('HDEL', KEYS[3], m) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - keep)
for i = 1, 4 do redis.call('EXPIRE', KEYS[i], math.ceil(keep + ttl)) end
return 1
