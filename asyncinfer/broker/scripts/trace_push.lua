-- Push requests that only need their trace written with them (asyncinfer/broker/publisher.py;
-- client/grouped.py sends it): generated IDs, no queue bound, no response cache, no sequence.
-- KEYS: the list to push on, the traces hash. ARGV: the queue's name (each trace's value), then
-- per request its ID and its message, in order. Returns the number of requests pushed. The
-- traces and the pushes are one step: after a crash or a failover a request's trace is there
-- exactly when its message was kept (publisher.py's module text).

local queue = ARGV[1]
local messages, traces = {}, {}
for i = 2, #ARGV, 2 do
  traces[#traces + 1] = ARGV[i]
  traces[#traces + 1] = queue
  messages[#messages + 1] = ARGV[i + 1]
end
for from = 1, #messages, 1000 do  -- oldest first, as one LPUSH each would leave them
  redis.call('LPUSH', KEYS[1], unpack(messages, from, math.min(from + 999, #messages)))
end
for from = 1, #traces, 2000 do
  redis.call('HSET', KEYS[2], unpack(traces, from, math.min(from + 1999, #traces)))
end
return #messages
