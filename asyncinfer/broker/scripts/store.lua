-- Store a batch of results and their acknowledgements (asyncinfer/broker/store.py).
-- KEYS: unacked_index, unacked, leases, lease holders, lease device marks, the traces hash. ARGV:
-- seconds a result lives (0: for ever), the storing worker's lease holder name ('' : acknowledge
-- whoever holds), the number N of traces to remove (the requests whose result is stored: from now
-- on the result says the request exists), those N request IDs, then five values per request (see
-- Entry in store.py). A tag leased to another holder now (its
-- lease lapsed here, the message went back and another worker took it) is not acknowledged: its
-- bookkeeping is the new holder's. Returns {the error
-- replies of the announcements and acknowledgements, the result keys not written}: a guarded
-- result (a sequence request's) never replaces a final state already stored for its request (the
-- FAILURE another worker's sweep wrote when this worker's registration lapsed: it is not
-- announced either, and the message is still acknowledged); a quiet one (guard 'q', a STARTED
-- state) is stored and not announced. The results of the batch that name one reply channel are
-- announced there in one message (wire/reply.py's grouped form when more than one).

local ttl = tonumber(ARGV[1])
-- On a Redis Cluster shard every key starts with the shard's hash tag (broker/cluster_keys.py); a
-- result's channel is its key's name without it, the name its waiters know (Celery's, ours).
local shard_tag = string.match(KEYS[1], '^{[^}]*}') or ''
local errors, skipped = {}, {}
local final = {SUCCESS = true, FAILURE = true, REVOKED = true}
local function try(...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply['err'] then errors[#errors + 1] = reply['err'] end
end
local function settled(key)
  local old = redis.pcall('GET', key)  -- another type's key: no state of a request
  if type(old) ~= 'string' then return false end
  local ok, meta = pcall(cjson.decode, old)
  return ok and type(meta) == 'table' and final[meta['status']] == true
end
local tags = {}
local replies, channels = {}, {}  -- the values announced on each reply channel, in order
local untraced = tonumber(ARGV[3])
for from = 4, 3 + untraced, 1000 do
  try('HDEL', KEYS[6], unpack(ARGV, from, math.min(from + 999, 3 + untraced)))
end
for i = 4 + untraced, #ARGV, 5 do
  local key, value, reply_to, tag = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local guard = ARGV[i + 4]
  if key ~= '' then
    if guard == '1' and settled(key) then
      skipped[#skipped + 1] = key
    else
      if ttl > 0 then redis.call('SETEX', key, ARGV[1], value) else redis.call('SET', key, value) end
      if guard ~= 'q' then  -- 'q': a STARTED state, stored and not announced
        try('PUBLISH', shard_tag == '' and key or string.sub(key, #shard_tag + 1), value)
        if reply_to ~= '' then
          local group = replies[reply_to]
          if not group then
            group = {}
            replies[reply_to] = group
            channels[#channels + 1] = reply_to
          end
          group[#group + 1] = value
        end
      end
    end
  end
  if tag ~= '' then tags[#tags + 1] = tag end
end
-- One message per reply channel: a lone value as it is, several grouped (wire/reply.py)
for _, channel in ipairs(channels) do
  local group = replies[channel]
  if #group == 1 then
    try('PUBLISH', channel, group[1])
  else
    local parts = {'\30'}
    for _, value in ipairs(group) do
      parts[#parts + 1] = #value .. ':' .. value
    end
    try('PUBLISH', channel, table.concat(parts))
  end
end
-- Only the tags this holder (or nobody) holds: one HMGET per 1,000 tags. A leased tag (one with
-- a holder) was never in kombu's unacked_index (the take records it there only unleased): only
-- the tags nobody holds are removed from the index.
local holder = ARGV[2]
local indexed = tags
if holder ~= '' and #tags > 0 then
  local mine, unheld, prefix = {}, {}, holder .. '\t'
  for from = 1, #tags, 1000 do
    local last = math.min(from + 999, #tags)
    local entries = redis.call('HMGET', KEYS[4], unpack(tags, from, last))
    for j = from, last do
      local entry = entries[j - from + 1]
      if not entry then
        mine[#mine + 1] = tags[j]
        unheld[#unheld + 1] = tags[j]
      elseif entry == holder or string.sub(entry, 1, #prefix) == prefix then
        mine[#mine + 1] = tags[j]
      end
    end
  end
  tags, indexed = mine, unheld
end
-- The acknowledgements: one variadic command per key for the whole batch, in calls of at most
-- 1,000 tags (unpack's stack has a limit).
for from = 1, #indexed, 1000 do
  try('ZREM', KEYS[1], unpack(indexed, from, math.min(from + 999, #indexed)))
end
for from = 1, #tags, 1000 do
  local last = math.min(from + 999, #tags)
  try('HDEL', KEYS[2], unpack(tags, from, last))
  try('ZREM', KEYS[3], unpack(tags, from, last))
  try('HDEL', KEYS[4], unpack(tags, from, last))
  try('HDEL', KEYS[5], unpack(tags, from, last))
end
return {errors, skipped}
