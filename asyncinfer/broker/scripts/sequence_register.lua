-- Register a worker for its models' sequences (asyncinfer/worker/requests/sequence_pins.py).
-- KEYS: the set of models with sequence workers, then each model's sorted set of them. ARGV: the
-- lease (s; 0: lapse now), then each model's member, then each model's name, then for each model
-- '1' when this is a renewal (the member was registered and must still be). Returns the models
-- whose renewal found the registration lapsed (gone, or its time past): those are not registered
-- again by this call (the worker first takes back what it ran meanwhile).

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local until_s = now + tonumber(ARGV[1])
if tonumber(ARGV[1]) <= 0 then until_s = 0 end
local n = #KEYS - 1
local lapsed = {}
for i = 1, n do
  local member, model = ARGV[i + 1], ARGV[n + i + 1]
  local score = nil
  if until_s > 0 and ARGV[2 * n + i + 1] == '1' then
    score = tonumber(redis.call('ZSCORE', KEYS[i + 1], member) or '0')
  end
  if score ~= nil and score < now then
    lapsed[#lapsed + 1] = model
  else
    redis.call('ZADD', KEYS[i + 1], until_s, member)
    redis.call('SADD', KEYS[1], model)
  end
end
return lapsed
