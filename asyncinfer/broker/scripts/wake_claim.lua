-- Claim or renew a list's watch (asyncinfer/broker/wake.py, via wake_scripts.py).
-- KEYS: a list's watch. ARGV: the consumer's token, the watch's lifetime (ms). 1 when this
-- consumer watches the list now (it took the watch, or renewed its own), else 0.

if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
