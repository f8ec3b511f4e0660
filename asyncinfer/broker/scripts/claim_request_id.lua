-- Claim a caller-chosen request ID (asyncinfer/client/sender.py). KEYS: the claim, the result.
-- ARGV: the claim's value, its TTL (s).
-- A caller-chosen ID's claim on the result backend (a broker other than Redis): nil when claimed
-- now, the stored claim when it was sent before, '' when only its result is there.

local claimed = redis.call('GET', KEYS[1])
if claimed then return claimed end
if redis.call('EXISTS', KEYS[2]) == 1 then return '' end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return false
