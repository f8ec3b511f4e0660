-- The atomic take of a worker's consumer (asyncinfer/broker/take.py; broker/atomic_take.py
-- loads it too).
-- KEYS: unacked_index, unacked, leases, lease holders; then, for each list whose watch the take may
-- pass on (wake.py), that list's watch, bell and count of consumers waiting for the bell; then the
-- lists to take from, in order.
-- ARGV: most messages to take, now (seconds), deepest nesting allowed; then the STARTED states to
-- store ('' for none: result key prefix, the stored text before and after the JSON of the request
-- ID, seconds it lives or 0, the task whose requests start); then the lease (seconds, 0 for none),
-- the holder, and the prefix of the death counts ('' to read none); then the taker's watch token
-- ('' for none), the number of watches given in KEYS, and each one's list as its position among
-- the lists (0 for the first).
-- Returns a flat list: the positions of the lists whose watch the taker gave up (a list, maybe
-- empty), then per message: list name, message, 1 if recorded (else 0), 1 if its STARTED was
-- stored (else 0), the worker deaths counted against its request.

local max_depth = tonumber(ARGV[3])

local function too_deep(value, depth)
  if type(value) ~= 'table' then return false end
  if depth > max_depth then return true end
  for _, v in pairs(value) do
    if too_deep(v, depth + 1) then return true end
  end
  return false
end

-- The envelope without its body: a base64 body has no quotes or backslashes, so cut it out
-- rather than decode megabytes of it; any other body is decoded with the rest.
local function envelope_of(msg)
  local s, e = string.find(msg, '"body"%s*:%s*"')
  local head = msg
  if s then
    local close = string.find(msg, '"', e + 1, true)
    if close and string.byte(msg, close - 1) ~= 92 then
      head = string.sub(msg, 1, e) .. string.sub(msg, close)
    end
  end
  local ok, env = pcall(cjson.decode, head)
  if not ok or type(env) ~= 'table' then return nil end
  local props = env['properties']
  if type(props) ~= 'table' or type(props['delivery_tag']) ~= 'string'
     or props['delivery_tag'] == '' then return nil end
  local headers = env['headers']
  if headers ~= nil and headers ~= cjson.null
     and (type(headers) ~= 'table' or headers[1] ~= nil) then return nil end  -- an object
  if too_deep(env, 1) then return nil end
  return env
end

local room = tonumber(ARGV[1])
local started_prefix, text_head, text_tail = ARGV[4], ARGV[5], ARGV[6]
local started_ttl, task_name = tonumber(ARGV[7]), ARGV[8]
local lease_s, holder, deaths_prefix = tonumber(ARGV[9]), ARGV[10], ARGV[11]
local watcher = ARGV[12]
local watches = tonumber(ARGV[13])
local first = 5 + 3 * watches  -- the first list's key
local expiry = 0
if lease_s > 0 then  -- Redis' clock, not the hosts'
  local t = redis.call('TIME')
  expiry = tonumber(t[1]) + tonumber(t[2]) / 1000000 + lease_s
end

-- Worker deaths counted against the request of env while it was on a device (leases.py): only
-- a redelivered message can have any (what a dead worker held comes back marked so).
local function deaths(env)
  if deaths_prefix == '' then return 0 end
  local h = env['headers']
  if type(h) ~= 'table' or type(h['id']) ~= 'string' or h['id'] == ''
     or h['redelivered'] == nil or h['redelivered'] == cjson.null or h['redelivered'] == false
  then return 0 end
  return tonumber(redis.call('GET', deaths_prefix .. h['id']) or '0') or 0
end

-- Store the STARTED state of a task of ours that is neither delayed (eta) nor redelivered (its
-- answer may be stored already: the consumer looks first); 1 if stored. Not announced: a waiter
-- on the request's channel (Celery's result consumer, our clients) acts on a final state only,
-- and a PUBLISH per request for nobody was a tenth of what a request cost Redis.
local function start(env)
  if started_prefix == '' then return 0 end
  local h = env['headers']
  if type(h) ~= 'table' or h['task'] ~= task_name or type(h['id']) ~= 'string' or h['id'] == ''
     or (h['eta'] ~= nil and h['eta'] ~= cjson.null and h['eta'] ~= '')
     or (h['redelivered'] ~= nil and h['redelivered'] ~= cjson.null and h['redelivered'] ~= false)
  then return 0 end
  local key = started_prefix .. h['id']
  local value = text_head .. cjson.encode(h['id']) .. text_tail
  if started_ttl > 0 then redis.call('SETEX', key, started_ttl, value)
  else redis.call('SET', key, value) end
  return 1
end

-- The bookkeeping of what is taken, written once per take with one variadic command per key
-- (not four commands per message): unacked_index, unacked, the leases and their holders.
local index_args, unacked_args, lease_args, holder_args = {}, {}, {}, {}
local function append(t, a, b) t[#t + 1] = a t[#t + 1] = b end
-- cmd key pairs...: in calls of at most 1,000 pairs (unpack's stack has a limit)
local function variadic(cmd, key, args)
  for from = 1, #args, 2000 do
    redis.call(cmd, key, unpack(args, from, math.min(from + 1999, #args)))
  end
end

local out = {}
local taken = 0
local stop = #KEYS + 1  -- where the take stopped when its room ran out
for i = first, #KEYS do
  local queue = KEYS[i]
  local sep = string.find(queue, '\6\22', 1, true)
  if sep then queue = string.sub(queue, 1, sep - 1) end
  local popped = redis.call('RPOP', KEYS[i], room - taken) or {}  -- oldest first; nil: empty
  for _, msg in ipairs(popped) do
    local env = envelope_of(msg)
    local recorded, started, died = 0, 0, 0
    if env then
      local props = env['properties']
      local info = props['delivery_info']
      local exchange, routing_key = '', queue
      if type(info) == 'table' then
        if type(info['exchange']) == 'string' then exchange = info['exchange'] end
        if type(info['routing_key']) == 'string' then routing_key = info['routing_key'] end
      end
      local tag = props['delivery_tag']
      append(index_args, ARGV[2], tag)
      append(unacked_args, tag,
             '[' .. msg .. ', ' .. cjson.encode(exchange) .. ', ' .. cjson.encode(routing_key) .. ']')
      if lease_s > 0 then
        append(lease_args, expiry, tag)
        append(holder_args, tag, holder .. '\t' .. KEYS[i])
      end
      recorded = 1
      started = start(env)
      died = deaths(env)
    end
    taken = taken + 1
    out[#out + 1] = KEYS[i]
    out[#out + 1] = msg
    out[#out + 1] = recorded
    out[#out + 1] = started
    out[#out + 1] = died
  end
  if taken >= room then stop = i break end
end
variadic('ZADD', KEYS[1], index_args)
variadic('HSET', KEYS[2], unacked_args)
variadic('ZADD', KEYS[3], lease_args)
variadic('HSET', KEYS[4], holder_args)
-- A consumer whose take took something is busy for a while: of the lists it watched and is not
-- blocked on now (those given in KEYS), it gives up the watch of each one for which other idle
-- consumers wait (or of every one, when it is full now and will not watch), and rings one bell
-- (the first such list's) so that one of them takes what came meanwhile and watches next; alone,
-- it keeps its watches (no round trip to claim them again). A take that filled its room and left
-- messages rings the first given list's bell too (one more consumer wakes to take them). At most
-- one bell rings per take: never all idle consumers.
local passed = {}
if watcher ~= '' and taken > 0 and watches > 0 then
  local ring = nil
  for j = 0, watches - 1 do
    local watch, bell, count = KEYS[5 + 3 * j], KEYS[6 + 3 * j], KEYS[7 + 3 * j]
    if redis.call('GET', watch) == watcher then
      local waiting = (tonumber(redis.call('GET', count) or '0') or 0) > 0
      if waiting or taken >= room then
        redis.call('DEL', watch)
        passed[#passed + 1] = tonumber(ARGV[14 + j])
        if waiting and not ring then ring = bell end
      end
    end
  end
  if not ring and taken >= room then
    for i = stop, #KEYS do
      if redis.call('LLEN', KEYS[i]) > 0 then ring = KEYS[6] break end
    end
  end
  if ring then
    redis.call('LPUSH', ring, '1')
    redis.call('LTRIM', ring, 0, 0)
    redis.call('PEXPIRE', ring, 60000)
  end
end
table.insert(out, 1, passed)
return out
