-- Count the consumers waiting for bells (asyncinfer/broker/wake.py, via wake_scripts.py).
-- KEYS: bells' counts of waiters. ARGV: +1 or -1. Never below 0; each lapses 30 s after its last
-- change (a waiter killed while it waited counts no longer).

for _, key in ipairs(KEYS) do
  local n = redis.call('INCRBY', key, ARGV[1])
  if n < 0 then redis.call('SET', key, 0) end
  redis.call('EXPIRE', key, 30)
end
return 0
