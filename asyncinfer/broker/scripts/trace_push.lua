-- Push requests that only need their trace written with them (asyncinfer/broker/publisher.py;
-- client/grouped.py sends it): generated IDs, no queue bound, no response cache, no sequence.
-- KEYS: the list to push on, then each request's claim key, in order. ARGV: the trace's TTL
-- (seconds), its value (the queue's name), then the messages in the order of their keys.
-- Returns the number of requests pushed. The trace and the push are one step: after a crash or a
-- failover the trace is there exactly when the message was kept (publisher.py's module text).

local ttl, value = ARGV[1], ARGV[2]
for from = 3, #ARGV, 1000 do  -- oldest first, as one LPUSH each would leave them
  redis.call('LPUSH', KEYS[1], unpack(ARGV, from, math.min(from + 999, #ARGV)))
end
for i = 2, #KEYS do
  redis.call('SET', KEYS[i], value, 'EX', ttl)
end
return #KEYS - 1
