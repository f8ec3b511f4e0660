-- Store a batch of results and their acknowledgements (asyncinfer/worker/output/store.py).
-- KEYS: unacked_index, unacked, leases, lease holders, lease device marks. ARGV: seconds a result
-- lives (0: for ever), then four values per request (see Entry in store.py). Returns the error
-- replies of the announcements and acknowledgements.

local ttl = tonumber(ARGV[1])
local errors = {}
local function try(...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply['err'] then errors[#errors + 1] = reply['err'] end
end
for i = 2, #ARGV, 4 do
  local key, value, reply_to, tag = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if key ~= '' then
    if ttl > 0 then redis.call('SETEX', key, ttl, value) else redis.call('SET', key, value) end
    try('PUBLISH', key, value)
    if reply_to ~= '' then try('PUBLISH', reply_to, value) end
  end
  if tag ~= '' then
    try('ZREM', KEYS[1], tag)
    try('HDEL', KEYS[2], tag)
    try('ZREM', KEYS[3], tag)
    try('HDEL', KEYS[4], tag)
    try('HDEL', KEYS[5], tag)
  end
end
return errors
