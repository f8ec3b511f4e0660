-- Put a dead letter back on its queue (asyncinfer/ops/dead.py).
-- KEYS: the dead-letter list, the queue, [the request's stored result].
-- ARGV: the entry as stored, the message to push.
-- Removes the entry; only if it was there, pushes the message and deletes the stored FAILURE.

if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
if KEYS[3] then redis.call('DEL', KEYS[3]) end
redis.call('LPUSH', KEYS[2], ARGV[2])
return 1
