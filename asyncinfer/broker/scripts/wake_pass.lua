-- Pass a watch on to a waiting consumer (asyncinfer/broker/wake.py, via wake_scripts.py).
-- KEYS: a list's watch, bell and count of waiters. ARGV: the consumer's token. A watcher thread
-- that fired while its consumer is busy gives the watch up and rings the bell when others wait
-- for it (1), else keeps it (0).

if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if (tonumber(redis.call('GET', KEYS[3]) or '0') or 0) <= 0 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('LPUSH', KEYS[2], '1')
redis.call('LTRIM', KEYS[2], 0, 0)
redis.call('PEXPIRE', KEYS[2], 60000)
return 1
