-- Spend from the retry budget (asyncinfer/policy/retry_budget.py).
-- KEYS: requests (this window, previous), retries (this window, previous).
-- ARGV: retries wanted, ratio, minimum, key TTL in seconds.
-- Returns {granted, requests in the two windows, retries already spent in them}.

local requests = tonumber(redis.call('GET', KEYS[1]) or '0') + tonumber(redis.call('GET', KEYS[2]) or '0')
local spent = tonumber(redis.call('GET', KEYS[3]) or '0') + tonumber(redis.call('GET', KEYS[4]) or '0')
local allowed = math.floor(tonumber(ARGV[2]) * requests + tonumber(ARGV[3])) - spent
local wanted = tonumber(ARGV[1])
if allowed < 0 then allowed = 0 end
if allowed > wanted then allowed = wanted end
if allowed > 0 then
  redis.call('INCRBY', KEYS[3], allowed)
  redis.call('EXPIRE', KEYS[3], ARGV[4])
end
return {allowed, requests, spent}
