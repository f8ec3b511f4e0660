-- Append to decoupled models' streams (asyncinfer/worker/output/stream_write.py).
-- ARGV: seconds a stream lives (0: for ever), how many entries back a start looks for itself (0:
-- not a call tried again), then seven values per entry: the stream's key, the kind, the part number
-- ('0' for a marker), the most entries the stream holds, and three values: a part's data ('', ''),
-- a start's worker, tag and attempt, a final's status and error (''; its 'parts' is the stream's
-- last part number). Returns how many entries were appended, then the error replies of keys that
-- are no streams.

local ttl, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local appended, errors = 0, {}
local function fields_of(raw)
  local fields = {}
  for j = 1, #raw, 2 do fields[raw[j]] = raw[j + 1] end
  return fields
end
local function started_already(key, worker, tag, attempt)
  for _, entry in ipairs(redis.call('XREVRANGE', key, '+', '-', 'COUNT', window)) do
    local f = fields_of(entry[2])
    if f['kind'] == 'start' then
      return f['worker'] == worker and f['tag'] == tag and f['attempt'] == attempt
    end
  end
  return false
end
for i = 3, #ARGV, 7 do
  local key, kind, n, maxlen = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local a, b, c = ARGV[i + 4], ARGV[i + 5], ARGV[i + 6]
  local last = redis.pcall('XREVRANGE', key, '+', '-', 'COUNT', 1)
  if type(last) == 'table' and last['err'] then
    errors[#errors + 1] = key .. ': ' .. last['err']
  else
    local part, seq, fields = '0', 0, {}
    if #last > 0 then
      local id = last[1][1]
      local dash = string.find(id, '-', 1, true)
      part, seq = string.sub(id, 1, dash - 1), tonumber(string.sub(id, dash + 1))
      fields = fields_of(last[1][2])
    end
    local id, entry = nil, nil
    if fields['kind'] == 'final' then
      id = nil
    elseif kind == 'part' then
      if tonumber(part) < tonumber(n) then id, entry = n .. '-0', {'kind', 'part', 'data', a} end
    elseif kind == 'start' then
      if window == 0 or #last == 0 or not started_already(key, a, b, c) then
        id, entry = part .. '-' .. (seq + 1), {'kind', 'start', 'worker', a, 'tag', b, 'attempt', c}
      end
    elseif kind == 'final' then
      id, entry = part .. '-' .. (seq + 1), {'kind', 'final', 'status', a, 'error', b, 'parts', part}
    end
    if id then
      local added = redis.pcall('XADD', key, 'MAXLEN', maxlen, id, unpack(entry))
      if type(added) == 'table' and added['err'] then
        -- memory and a read-only replica refuse the first write: the whole call, tried again
        if string.find(added['err'], 'OOM', 1, true) or string.find(added['err'], 'READONLY', 1, true) then
          return added
        end
        errors[#errors + 1] = key .. ': ' .. added['err']
      else
        if ttl > 0 then redis.call('EXPIRE', key, ttl) end
        appended = appended + 1
      end
    end
  end
end
return {appended, errors}
