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
-- the lists (0 for the first); then the largest body kept, in bytes of its text (0: any).
-- Returns a flat list: the positions of the lists whose watch the taker gave up (a list, maybe
-- empty), then per message: list name, message, 1 if recorded (else 0; -N: recorded, and its
-- body of N bytes, over the largest kept, left out of what is recorded and returned), 1 if its
-- STARTED was stored (else 0), the worker deaths counted against its request.
--
-- A body over the largest kept is cut out (the consumer refuses the request for its size, and
-- needs no more to name it): a 200 MB message no longer costs Redis a second copy in unacked, a
-- third while the entry is built and a fourth in the reply.
--
-- A leased take (lease > 0) reads what it needs of a message from its text where the text says
-- each field plainly (as kombu, Celery and our producers write them; its tag and request ID
-- once), without decoding the envelope, and records it in unacked (with no exchange and the
-- queue as the routing key: the leases put it back), the leases and their holders, not in kombu's
-- unacked_index (the leases give it back; kombu's sweep, which loads what the index names, never
-- meets it). The consumer decodes every message and answers one that is no envelope, recorded
-- or not. An unleased take (kombu's restore sweep is its only way back) decodes each envelope and
-- records only what that sweep can load, in the index too.

local max_depth = tonumber(ARGV[3])

-- The envelope's text without its body: a base64 body has no quotes or backslashes, so cut it
-- out rather than decode (or search) megabytes of it; any other body stays.
local function without_body(msg)
  local s, e = string.find(msg, '"body":"', 1, true)  -- kombu's and our producers' forms first
  if not s then s, e = string.find(msg, '"body": "', 1, true) end
  if not s then s, e = string.find(msg, '"body"%s*:%s*"') end
  if s then
    local close = string.find(msg, '"', e + 1, true)
    if close and string.byte(msg, close - 1) ~= 92 then
      return string.sub(msg, 1, e) .. string.sub(msg, close)
    end
  end
  return msg
end

-- The envelope, decoded from its text without its body; nil if it breaks the rules of a kombu
-- message.
local function envelope_of(head)
  -- cjson enforces the nesting rule as it decodes (a walk of the decoded tables afterwards cost
  -- more than the decode's own checks); its default (1000) is restored for every other script
  cjson.decode_max_depth(max_depth)
  local ok, env = pcall(cjson.decode, head)
  cjson.decode_max_depth(1000)
  if not ok or type(env) ~= 'table' then return nil end
  local props = env['properties']
  if type(props) ~= 'table' or type(props['delivery_tag']) ~= 'string'
     or props['delivery_tag'] == '' then return nil end
  local headers = env['headers']
  if headers ~= nil and headers ~= cjson.null
     and (type(headers) ~= 'table' or headers[1] ~= nil) then return nil end  -- an object
  return env
end

local room = tonumber(ARGV[1])
local started_prefix, text_head, text_tail = ARGV[4], ARGV[5], ARGV[6]
local started_ttl, task_name = tonumber(ARGV[7]), ARGV[8]
local lease_s, holder, deaths_prefix = tonumber(ARGV[9]), ARGV[10], ARGV[11]
local watcher = ARGV[12]
local watches = tonumber(ARGV[13])
local max_body = tonumber(ARGV[14 + watches]) or 0
local first = 5 + 3 * watches  -- the first list's key
local expiry = 0  -- as text: a number argument is formatted again for each message it scores
if lease_s > 0 then  -- Redis' clock, not the hosts'
  local t = redis.call('TIME')
  expiry = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000 + lease_s)
end

-- What the take reads of a message (nil: not recorded): its delivery tag; the exchange and
-- routing key of kombu's unacked entry; of its headers the request ID and task (nil if not
-- strings), whether it has an eta and whether it was redelivered.
local function decoded(head, queue)
  local env = envelope_of(head)
  if not env then return nil end
  local props = env['properties']
  local info = props['delivery_info']
  local f = {tag = props['delivery_tag'], exchange = '', routing_key = queue,
             eta = false, redelivered = false}
  if type(info) == 'table' then
    if type(info['exchange']) == 'string' then f.exchange = info['exchange'] end
    if type(info['routing_key']) == 'string' then f.routing_key = info['routing_key'] end
  end
  local h = env['headers']
  if type(h) == 'table' then
    if type(h['id']) == 'string' then f.id = h['id'] end
    if type(h['task']) == 'string' then f.task = h['task'] end
    f.eta = h['eta'] ~= nil and h['eta'] ~= cjson.null and h['eta'] ~= ''
    f.redelivered = h['redelivered'] ~= nil and h['redelivered'] ~= cjson.null
                    and h['redelivered'] ~= false
  end
  return f
end

-- The string value of the key `quoted` (the key's name in quotes) in head, written plainly
-- ("name":"value" or "name": "value", no escapes in the value): the value; nil when the key is
-- absent or null; false otherwise, and, when `once`, when the text says the key more than once.
-- In valid JSON a quoted name followed by a colon is always a key: a string cannot hold an
-- unescaped quote.
local function plain(head, quoted, once)
  local s, e = string.find(head, quoted, 1, true)
  if not s then return nil end
  if once and string.find(head, quoted, e + 1, true) then return false end
  local value = string.match(head, '^%s*:%s*"([^"\\]*)"', e + 1)
  if value then return value end
  if string.find(head, '^%s*:%s*null', e + 1) then return nil end
  return false
end

-- The fields of a message read from its text without decoding it; nil when the text does not
-- say them plainly (an escape anywhere outside the body, its tag or request ID twice), or the
-- message was redelivered (its death count is read from its decoded headers): the take decodes
-- it then. Each scan of the text costs Redis ~3,000 instructions, a tenth of a take's work per
-- message, so only what must be one key's is checked for a second: the tag (the bookkeeping's
-- key) and the request ID (the STARTED state's key). The task and the eta are read where the text
-- first says them: they decide only whether a STARTED state is stored. kombu's exchange and
-- routing key are not read: a leased message goes back on the list its holder entry names.
local function read_plainly(head)
  -- no backslash: every string in it says what it is, so a key found by its text is that key
  if string.find(head, '\\', 1, true) or string.find(head, '"redelivered"', 1, true) then
    return nil
  end
  local tag = plain(head, '"delivery_tag"', true)
  if not tag or tag == '' then return nil end
  local id, task = plain(head, '"id"', true), plain(head, '"task"', false)
  local eta = plain(head, '"eta"', false)
  if id == false or task == false or eta == false then return nil end
  return {tag = tag, id = id, task = task, eta = eta ~= nil and eta ~= '', redelivered = false}
end

-- Worker deaths counted against the request of f while it was on a device (leases.py): only
-- a redelivered message can have any (what a dead worker held comes back marked so).
local function deaths(f)
  if deaths_prefix == '' or not f.redelivered or not f.id or f.id == '' then return 0 end
  return tonumber(redis.call('GET', deaths_prefix .. f.id) or '0') or 0
end

-- Store the STARTED state of a task of ours that is neither delayed (eta) nor redelivered (its
-- answer may be stored already: the consumer looks first); 1 if stored. Not announced: a waiter
-- on the request's channel (Celery's result consumer, our clients) acts on a final state only,
-- and a PUBLISH per request for nobody was a tenth of what a request cost Redis.
local function start(f)
  if started_prefix == '' or f.task ~= task_name or not f.id or f.id == '' or f.eta
     or f.redelivered then return 0 end
  local key = started_prefix .. f.id
  local value = text_head .. cjson.encode(f.id) .. text_tail
  if started_ttl > 0 then redis.call('SETEX', key, ARGV[7], value)
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
  local held_by = holder .. '\t' .. queue  -- each message's holder entry: made once a list
  local sep = string.find(queue, '\6\22', 1, true)
  if sep then queue = string.sub(queue, 1, sep - 1) end
  -- a leased message's kombu entry ends the same for the whole list (no exchange: the queue)
  local leased_tail = ', "", ' .. cjson.encode(queue) .. ']'
  local popped = redis.call('RPOP', KEYS[i], room - taken) or {}  -- oldest first; nil: empty
  for _, msg in ipairs(popped) do
    local head = without_body(msg)
    local cut = 0
    if max_body > 0 and #msg - #head > max_body then
      cut = #msg - #head
      msg = head
    end
    local f = nil
    if lease_s > 0 then f = read_plainly(head) end
    if f == nil then f = decoded(head, queue) end
    local recorded, started, died = 0, 0, 0
    if f then
      local tag = f.tag
      if lease_s > 0 then
        append(unacked_args, tag, '[' .. msg .. leased_tail)
        append(lease_args, expiry, tag)
        append(holder_args, tag, held_by)
      else
        append(unacked_args, tag, '[' .. msg .. ', ' .. cjson.encode(f.exchange) .. ', '
                                  .. cjson.encode(f.routing_key) .. ']')
        append(index_args, ARGV[2], tag)
      end
      recorded = 1
      started = start(f)
      died = deaths(f)
    end
    taken = taken + 1
    out[#out + 1] = KEYS[i]
    out[#out + 1] = msg
    if recorded == 1 and cut > 0 then out[#out + 1] = -cut else out[#out + 1] = recorded end
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
