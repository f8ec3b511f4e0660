-- Claim the watches nobody holds (asyncinfer/broker/wake.py, via wake_scripts.py).
-- KEYS: the first list's watch, then the watches of other lists this consumer does not hold. ARGV:
-- the consumer's token, the first watch's lifetime, the others' (ms). The first is claimed or
-- renewed as wake_claim.lua does; each other one is taken only if nobody holds it. Per key, 1 when
-- this consumer holds it now, else 0.

local out = {}
for i, key in ipairs(KEYS) do
  local lifetime = ARGV[3]
  if i == 1 then lifetime = ARGV[2] end
  if redis.call('SET', key, ARGV[1], 'NX', 'PX', lifetime) then
    out[i] = 1
  elseif redis.call('GET', key) == ARGV[1] then
    redis.call('PEXPIRE', key, lifetime)
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
