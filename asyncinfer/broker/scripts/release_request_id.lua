-- Release a caller-chosen request ID's claim whose send failed (asyncinfer/client/sender.py).
-- KEYS: the claim. ARGV: the claim's value as this producer set it.
-- Deleted only while it is still this producer's: 1 when released, 0 otherwise.

if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
