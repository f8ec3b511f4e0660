-- Renew a holder's leases (asyncinfer/broker/leases.py).
-- KEYS: leases, holders, unacked_index. ARGV: lease (s), holder, the host's time now, the prefix
-- of the reclaimed marks, then tags.
-- Renews the lease of each tag this holder still holds (and its kombu time). Returns {the tags
-- leased to another or gone back to their queue (a reclaimed mark says so), the tags no holder
-- has and that never went back: Redis forgot them (the holder may take them again)}.

local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[1])
local mine = ARGV[2] .. '\t'
local lost, forgotten = {}, {}
for i = 5, #ARGV do
  local tag = ARGV[i]
  local h = redis.call('HGET', KEYS[2], tag)
  if h and string.sub(h, 1, #mine) == mine then
    redis.call('ZADD', KEYS[1], expiry, tag)
    redis.call('ZADD', KEYS[3], 'XX', ARGV[3], tag)
  elseif h or redis.call('EXISTS', ARGV[4] .. tag) == 1 then
    lost[#lost + 1] = tag
  else
    forgotten[#forgotten + 1] = tag
  end
end
return {lost, forgotten}
