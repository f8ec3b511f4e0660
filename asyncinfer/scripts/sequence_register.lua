-- Register a worker for its models' sequences (asyncinfer/worker/intake/sequence_pins.py).
-- KEYS: the set of models with sequence workers, then each model's sorted set of them. ARGV: the
-- lease (s; 0: lapse now), then each model's member, then each model's name.

local t = redis.call('TIME')
local until_s = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
if tonumber(ARGV[1]) <= 0 then until_s = 0 end
local n = #KEYS - 1
for i = 1, n do
  redis.call('ZADD', KEYS[i + 1], until_s, ARGV[i + 1])
  redis.call('SADD', KEYS[1], ARGV[n + i + 1])
end
return n
