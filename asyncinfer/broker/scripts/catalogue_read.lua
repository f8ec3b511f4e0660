-- Read the catalogue (asyncinfer/broker/catalogue.py). KEYS: as catalogue_announce.lua.
-- ARGV: retention_s. Returns {live members, their host JSON, known models, their metadata JSON}.

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local live = redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')
local known = redis.call('ZRANGEBYSCORE', KEYS[2], now - tonumber(ARGV[1]), '+inf')
local hosts, meta = {}, {}
for i, m in ipairs(live) do hosts[i] = redis.call('HGET', KEYS[4], m) or '' end
for i, m in ipairs(known) do meta[i] = redis.call('HGET', KEYS[3], m) or '' end
return {live, hosts, known, meta}
