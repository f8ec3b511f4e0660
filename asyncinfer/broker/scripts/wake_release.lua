-- Release a closing consumer's watches (asyncinfer/broker/wake.py, via wake_scripts.py).
-- KEYS: the watches of a consumer's lists. ARGV: its token. Deletes each one it holds (a closing
-- consumer's: its successor, a restarted worker or the same worker's new queues, claims them at
-- once instead of after their lifetime); how many.

local released = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('DEL', key)
    released = released + 1
  end
end
return released
