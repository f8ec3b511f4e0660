-- Record which weights answer a model's requests now (asyncinfer/broker/response_cache.py).
-- KEYS: generation keys. ARGV: per key, '+' then the token to set, or '-' then the token to remove
-- (removed only while it is still the key's: another worker's later load stands).
-- Returns the number of keys changed.

local changed = 0
for i = 1, #KEYS do
  local op, token = ARGV[2 * i - 1], ARGV[2 * i]
  if op == '+' then
    if redis.call('GET', KEYS[i]) ~= token then
      redis.call('SET', KEYS[i], token)
      changed = changed + 1
    end
  elseif redis.call('GET', KEYS[i]) == token then
    redis.call('DEL', KEYS[i])
    changed = changed + 1
  end
end
return changed
