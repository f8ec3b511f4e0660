"""Putting a request on a Redis queue: idempotency and the queue bound, in one round trip.

One Lua script per request, run by Redis atomically:

- idempotency: a request sent with a caller-chosen ID claims ``asyncinfer:request:<id>`` (TTL: the
  result expiry). A second submit of the same ID finds the claim (or the stored result) and
  publishes nothing; the caller gets the first request's future. Generated IDs (UUID4) cannot
  collide and claim nothing;
- wake-up: it rings the queue's doorbell (a one-element list with a TTL), which waiting workers
  pop instead of the request itself, so a request never sits in a worker's memory unrecorded;
- backpressure: with a ``max_queue_size``, a queue already holding that many requests takes no
  more; :meth:`Publisher.publish` waits up to ``timeout_s`` for room, then raises QueueFull.
  Nothing is dropped: a request is either on the queue or refused at submit.
"""

from __future__ import annotations

import time
from typing import Any

from asyncinfer.constants import doorbell_for
from asyncinfer.errors import QueueFull

__all__ = ["Publisher", "PUBLISHED", "DUPLICATE", "CLAIM_PREFIX"]

CLAIM_PREFIX = "asyncinfer:request:"
PUBLISHED, DUPLICATE, FULL = 1, 0, -1

# KEYS: queue, claim key, result key, the queue's doorbell.
# ARGV: message, max queue size (0: none), claim TTL (0: none), doorbell TTL.
# Returns 1 published, 0 already sent, or -(queue length) - 1 when the queue is full.
_PUBLISH = """
local claim_ttl = tonumber(ARGV[3])
if claim_ttl > 0 and (redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 1) then
  return 0
end
local bound = tonumber(ARGV[2])
if bound > 0 then
  local depth = redis.call('LLEN', KEYS[1])
  if depth >= bound then return -depth - 1 end
end
if claim_ttl > 0 then redis.call('SET', KEYS[2], '1', 'EX', claim_ttl) end
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('LPUSH', KEYS[4], '1')
redis.call('LTRIM', KEYS[4], 0, 0)
redis.call('EXPIRE', KEYS[4], ARGV[4])
return 1
"""

#: A doorbell outlives no idle period worth waking for (a starting worker looks at its queues).
DOORBELL_TTL_S = 300


class Publisher:
    """Publishes task messages on the Redis broker ``client``."""

    #: Between two looks at a full queue (seconds): from the first to the last.
    poll_s = (0.002, 0.05)

    def __init__(self, client: Any, *, claim_ttl_s: float) -> None:
        self.client = client
        self.claim_ttl_s = max(1, int(claim_ttl_s)) if claim_ttl_s else 0
        self._publish = client.register_script(_PUBLISH)

    def publish(self, queue: str, request_id: str, message: str, *, claim: bool,
                result_key: str | None = None, max_queue_size: int = 0,
                timeout_s: float = 0.0) -> int:
        """LPUSH ``message`` on ``queue``. Returns PUBLISHED, or DUPLICATE when ``claim`` is set
        and the request ID was already sent (or its result is stored under ``result_key``).
        Raises QueueFull when the queue stays at ``max_queue_size`` for ``timeout_s``."""
        claim_key = CLAIM_PREFIX + request_id
        keys = [queue, claim_key, result_key or claim_key, doorbell_for(queue)]
        args = [message, max(0, int(max_queue_size)), self.claim_ttl_s if claim else 0,
                DOORBELL_TTL_S]
        deadline = time.monotonic() + max(0.0, timeout_s)
        pause_s = self.poll_s[0]
        while True:
            reply = int(self._publish(keys=keys, args=args))
            if reply >= 0:
                return reply
            if time.monotonic() >= deadline:
                depth = -reply - 1
                raise QueueFull(f"request {request_id}: queue {queue} holds {depth} requests, at its "
                                f"bound (max_queue_size {max_queue_size}); not accepted"
                                + (f" after waiting {timeout_s:g} s" if timeout_s > 0 else ""))
            time.sleep(min(pause_s, max(0.0, deadline - time.monotonic())))
            pause_s = min(pause_s * 2, self.poll_s[1])
