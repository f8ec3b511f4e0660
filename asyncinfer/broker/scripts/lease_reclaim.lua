-- Reclaim expired leases or a dead holder's (asyncinfer/broker/leases.py).
-- KEYS: leases, holders, device marks, unacked_index, unacked. ARGV: 1 to reclaim only expired
-- leases (else those of a dead holder, expired or not), the deaths prefix, the deaths' lifetime
-- (s), the prefix of the reclaimed marks, then per tag: tag, the holder entry it was read with,
-- the list to put it back on ('' for none), the message as it goes back. Returns {messages put
-- back, deaths counted}. Each tag reclaimed is marked so for as long as deaths are counted (its
-- late holder's renewal reads it: the message went back, Redis did not forget it).

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local back, deaths = 0, 0
for i = 5, #ARGV, 4 do
  local tag, holder, list, text = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local ok = (redis.call('HGET', KEYS[2], tag) or '') == holder
  if ok and ARGV[1] == '1' then
    local score = redis.call('ZSCORE', KEYS[1], tag)
    ok = score ~= false and tonumber(score) <= now
  end
  if ok then
    local rid = redis.call('HGET', KEYS[3], tag)
    if rid and ARGV[2] ~= '' then
      redis.call('INCR', ARGV[2] .. rid)
      redis.call('EXPIRE', ARGV[2] .. rid, tonumber(ARGV[3]))
      deaths = deaths + 1
    end
    if list ~= '' and redis.call('HEXISTS', KEYS[5], tag) == 1 then
      redis.call('RPUSH', list, text)
      back = back + 1
    end
    redis.call('ZREM', KEYS[1], tag)
    redis.call('HDEL', KEYS[2], tag)
    redis.call('HDEL', KEYS[3], tag)
    redis.call('ZREM', KEYS[4], tag)
    redis.call('HDEL', KEYS[5], tag)
    redis.call('SET', ARGV[4] .. tag, '1', 'EX', tonumber(ARGV[3]))
  end
end
return {back, deaths}
