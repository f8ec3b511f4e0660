-- Announce a stored final result on the request's reply channel (asyncinfer/broker/result_announcements.py).
-- KEYS[1]: the result key; ARGV[1]: the reply channel. Publishes the stored payload, if any.

local stored = redis.call('GET', KEYS[1])
if stored then redis.call('PUBLISH', ARGV[1], stored) return 1 end
return 0
