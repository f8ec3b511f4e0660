-- Publish requests (asyncinfer/broker/publisher.py; grouped.py and loop_publisher.py send it too).
-- One or more pushes onto one queue, in order, atomically: the same rules for each push.
-- KEYS: the queue's lists (its priority lists, ARGV[1] of them), then per push: the list to push
-- on, its claim key, its result key, its response cache key's stem ('' for none), the model's cache
-- counts ('' for none), its sequence's pin and the model's sequence workers ('' for none), its
-- cache key's generation ('' for none: the token of the weights answering it now, appended to the
-- stem with ':' to give the entry; none stored, a miss); last, the traces hash.
-- ARGV: the number of the queue's lists, max queue size (0: none), queue name, then per push: its
-- message, claim TTL (0: none), the ID to trace ('' for none: a generated ID's trace, a field of
-- the traces hash, written with its push), its request ID as JSON, its reply channel, the result TTL (0: none),
-- the bound of the list it goes on (its priority level's max_queue_size; 0: none), its identity
-- (the claim's value, wire/request_identity.py: the queue, then its fingerprint), its sequence
-- (0: none, 1: it starts one, 2: a later request of one), 1 if it ends its sequence (else 0).
-- Returns per push a status and a detail: {1, ''} published, {0, ''} already sent to this queue
-- with the same identity (or one too bare to tell), {-1, queue length} the queue is full, {-2, the
-- claim} the ID was sent to another queue, {-4, the claim} sent to this queue with another
-- identity, {-3, list length} its priority level's list is full, {2, ''} answered from the response
-- cache (stored and announced as a worker would; not pushed), {-5, ''} a sequence not started, {-6,
-- ''} no live worker to start one on, {-7, the pin} its worker is gone.
-- Once the queue is found full, no push after it in the same call passes it: the queue stays full.
-- A claim's parts are separated by byte 31 (ASCII unit separator, Lua's '\31':
-- wire/request_identity.py's SEP).

local lists, bound, queue = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
-- On a Redis Cluster shard every key starts with the shard's hash tag (broker/cluster_keys.py): a
-- result's channel is its key's name without it, the name its waiters know.
local shard_tag = string.match(KEYS[1], '^{[^}]*}') or ''
local traces = KEYS[#KEYS]
local depth = nil
local out = {}
-- The pushes accepted, per list in order, made at the end with one LPUSH per list; a list's
-- length counts what is pending for it.
local pending, targets = {}, {}
local function llen(key)
  return redis.call('LLEN', key) + (pending[key] and #pending[key] or 0)
end
local function fill(stored, id)
  local cut = string.find(stored, ';', 1, true)
  if not cut then return nil end  -- not a template: a miss
  local pieces, at = {}, cut + 1
  for length in string.gmatch(string.sub(stored, 1, cut - 1), '%d+') do
    pieces[#pieces + 1] = string.sub(stored, at, at + tonumber(length) - 1)
    at = at + tonumber(length)
  end
  return table.concat(pieces, id)
end
-- Whether a key is given: '' names none (on a Redis Cluster shard it comes as the shard's hash
-- tag alone, '{...}', every key of a script being in its slot: broker/cluster_keys.py).
local function named(key) return key ~= '' and not string.find(key, '^{[^}]*}$') end
local function first_field(member) return string.sub(member, 1, string.find(member, '\t', 1, true) - 1) end
-- A sequence's push: the list it goes on (its pinned worker's), or a refusal
local function route(pin_key, workers, mode, ends)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local pin = redis.call('GET', pin_key)
  local alive = false
  if pin then
    local until_s = redis.call('ZSCORE', workers, pin)
    alive = until_s ~= false and tonumber(until_s) >= now
  end
  if mode == 1 and not alive then  -- a START: the live worker holding the fewest, in turns
    local live = redis.call('ZRANGEBYSCORE', workers, now, '+inf')
    if #live == 0 then return nil, -6, '' end
    local turn = redis.call('INCR', workers .. ':turn') % #live
    local best, fewest = nil, nil
    for j = 0, #live - 1 do
      local member = live[(turn + j) % #live + 1]
      local held = llen(first_field(member))
      if not best or held < fewest then best, fewest = member, held end
    end
    pin = best
  elseif not pin then
    return nil, -5, ''
  elseif not alive then
    return nil, -7, pin
  end
  if ends == 1 then
    redis.call('DEL', pin_key)
  else
    local timeout_s = tonumber(string.match(pin, '\t([^\t]*)$')) or 60
    redis.call('SET', pin_key, pin, 'EX', math.max(1, math.ceil(timeout_s)))
  end
  return first_field(pin), nil, ''
end
for i = 0, (#ARGV - 3) / 10 - 1 do
  local k, a = lists + 8 * i, 4 + 10 * i
  local claim_ttl = tonumber(ARGV[a + 1])
  local status, detail = nil, ''
  if claim_ttl > 0 then
    local claimed = redis.call('GET', KEYS[k + 2])
    if claimed then
      local mine = ARGV[a + 7]
      local cut = string.find(claimed, '\31', 1, true)
      local claimed_queue = cut and string.sub(claimed, 1, cut - 1) or claimed
      if claimed == mine or claimed == '1' then
        status = 0
      elseif claimed_queue ~= queue then
        status, detail = -2, claimed
      elseif claimed == queue or mine == queue then
        status = 0  -- a claim or a request too bare to compare: the request it names
      else
        status, detail = -4, claimed
      end
    elseif redis.call('EXISTS', KEYS[k + 3]) == 1 then
      status = 0
    end
  end
  if not status and named(KEYS[k + 4]) then
    local generation = named(KEYS[k + 8]) and redis.call('GET', KEYS[k + 8])
    local stored = generation and redis.call('GET', KEYS[k + 4] .. ':' .. generation)
    local value = stored and fill(stored, ARGV[a + 3])
    if value then
      local result_ttl = tonumber(ARGV[a + 5])
      if result_ttl > 0 then
        redis.call('SETEX', KEYS[k + 3], result_ttl, value)
      else
        redis.call('SET', KEYS[k + 3], value)
      end
      redis.call('PUBLISH', string.sub(KEYS[k + 3], #shard_tag + 1), value)  -- the key's name: its channel
      if ARGV[a + 4] ~= '' then redis.call('PUBLISH', ARGV[a + 4], value) end
      redis.call('HINCRBY', KEYS[k + 5], 'hits', 1)
      status = 2
    else
      redis.call('HINCRBY', KEYS[k + 5], 'misses', 1)
    end
  end
  local sequence = tonumber(ARGV[a + 8])
  local target = KEYS[k + 1]
  if not status and sequence > 0 then
    target, status, detail = route(KEYS[k + 6], KEYS[k + 7], sequence, tonumber(ARGV[a + 9]))
  end
  if not status and bound > 0 and sequence == 0 then
    if not depth then
      depth = 0
      for j = 1, lists do depth = depth + llen(KEYS[j]) end
    end
    if depth >= bound then status, detail = -1, depth end
  end
  local level_bound = tonumber(ARGV[a + 6])
  if not status and level_bound > 0 and sequence == 0 then
    local held = llen(KEYS[k + 1])
    if held >= level_bound then status, detail = -3, held end
  end
  if not status then
    if claim_ttl > 0 then
      redis.call('SET', KEYS[k + 2], ARGV[a + 7], 'EX', claim_ttl)
    elseif ARGV[a + 2] ~= '' then
      redis.call('HSET', traces, ARGV[a + 2], queue)
    end
    if not pending[target] then
      pending[target] = {}
      targets[#targets + 1] = target
    end
    local queued = pending[target]
    queued[#queued + 1] = ARGV[a]
    if depth and sequence == 0 then depth = depth + 1 end
    status = 1
  end
  out[#out + 1] = status
  out[#out + 1] = detail
end
for _, target in ipairs(targets) do  -- oldest first, as one LPUSH each would leave them
  local queued = pending[target]
  for from = 1, #queued, 1000 do
    redis.call('LPUSH', target, unpack(queued, from, math.min(from + 999, #queued)))
  end
end
return out
