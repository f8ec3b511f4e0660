-- Take a dead letter off its list before kombu publishes it again (asyncinfer/ops/dead.py).
-- KEYS: the dead-letter list, [the request's stored result]. ARGV: the entry as stored.
-- Removes the entry; only if it was there, deletes the stored FAILURE (the message is published
-- after, by kombu).

if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
if KEYS[2] then redis.call('DEL', KEYS[2]) end
return 1
