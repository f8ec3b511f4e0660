"""Putting a request on a Redis queue: idempotency and the queue bound, in one round trip.

One Lua script per request, run by Redis atomically:

- idempotency: a request sent with a caller-chosen ID claims ``asyncinfer:request:<id>`` (TTL: the
  result expiry; the claim holds the queue it went to). A second submit of the same ID to the same
  queue finds the claim (or the stored result) and publishes nothing; the caller gets the first
  request's future. The same ID sent to another queue (another model) is refused with
  InvalidRequest: its answer would be the first model's. Generated IDs (UUID4) cannot collide and
  claim nothing;
- backpressure: with a ``max_queue_size``, a queue already holding that many requests takes no
  more; :meth:`Publisher.publish` waits up to ``timeout_s`` for room, then raises QueueFull.
  Nothing is dropped: a request is either on the queue or refused at submit.

Idle workers wake without popping (workers/wake.py), so the push is all a producer does. With
neither a claim nor a bound to check (a generated ID, no ``max_queue_size``), it is a plain LPUSH.
"""

from __future__ import annotations

import time
from typing import Any

from asyncinfer.connections import require_replicas
from asyncinfer.constants import priority_list, priority_lists
from asyncinfer.errors import InvalidRequest, QueueFull
from asyncinfer.keys import CLAIM_PREFIX

__all__ = ["Publisher", "PUBLISHED", "DUPLICATE"]

PUBLISHED, DUPLICATE, FULL, CONFLICT = 1, 0, -1, -2

# KEYS: the list to push on, claim key, result key, then every list of the queue (its priority lists).
# ARGV: message, max queue size (0: none), claim TTL (0: none), queue name.
# Returns {1} published, {0} already sent to this queue, {-1, queue length} when the queue is full,
# {-2, other queue} when the ID was sent to another queue.
_PUBLISH = """
local claim_ttl = tonumber(ARGV[3])
if claim_ttl > 0 then
  local claimed = redis.call('GET', KEYS[2])
  if claimed then
    if claimed ~= ARGV[4] and claimed ~= '1' then return {-2, claimed} end
    return {0}
  end
  if redis.call('EXISTS', KEYS[3]) == 1 then return {0} end
end
local bound = tonumber(ARGV[2])
if bound > 0 then
  local depth = 0
  for i = 4, #KEYS do depth = depth + redis.call('LLEN', KEYS[i]) end
  if depth >= bound then return {-1, depth} end
end
if claim_ttl > 0 then redis.call('SET', KEYS[2], ARGV[4], 'EX', claim_ttl) end
redis.call('LPUSH', KEYS[1], ARGV[1])
return {1}
"""


class Publisher:
    """Publishes task messages on the Redis broker ``client``."""

    #: Between two looks at a full queue (seconds): from the first to the last.
    poll_s = (0.002, 0.05)

    def __init__(self, client: Any, *, claim_ttl_s: float, replicas: int = 0,
                 replicas_timeout_s: float = 1.0) -> None:
        self.client = client
        #: ASYNCINFER_SUBMIT_REPLICAS: a publish returns once this many replicas hold it.
        self.replicas = replicas
        self.replicas_timeout_ms = max(1, int(replicas_timeout_s * 1000))
        self.claim_ttl_s = max(1, int(claim_ttl_s)) if claim_ttl_s else 0
        self._publish = client.register_script(_PUBLISH)

    def publish(self, queue: str, request_id: str, message: str, *, claim: bool,
                result_key: str | None = None, max_queue_size: int = 0,
                timeout_s: float = 0.0, priority: int = 0) -> int:
        """LPUSH ``message`` on ``queue``. Returns PUBLISHED, or DUPLICATE when ``claim`` is set
        and the request ID was already sent (or its result is stored under ``result_key``).
        Raises QueueFull when the queue (all its priority lists) stays at ``max_queue_size`` for
        ``timeout_s``. ``priority`` (0-9) picks the list as kombu's Redis transport does."""
        claim_key = CLAIM_PREFIX + request_id
        keys = [priority_list(queue, priority), claim_key, result_key or claim_key,
                *priority_lists([queue])]
        args = [message, max(0, int(max_queue_size)), self.claim_ttl_s if claim else 0, queue]
        deadline = time.monotonic() + max(0.0, timeout_s)
        pause_s = self.poll_s[0]
        while True:
            if claim or max_queue_size > 0:
                reply = self._publish(keys=keys, args=args)
            else:  # nothing to check: the script would only push
                self.client.lpush(keys[0], message)
                reply = [PUBLISHED]
            status = int(reply[0])
            if status >= 0:
                if self.replicas:  # also for DUPLICATE: the first send may not be replicated yet
                    require_replicas(self.client, self.replicas, self.replicas_timeout_ms,
                                     f"request {request_id}")
                return status
            if status == CONFLICT:
                other = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
                raise InvalidRequest(f"request {request_id}: this request ID was already sent to "
                                     f"queue {other}; an ID names one request (for one model), so "
                                     f"it cannot be sent to {queue}")
            if time.monotonic() >= deadline:
                depth = int(reply[1])
                raise QueueFull(f"request {request_id}: queue {queue} holds {depth} requests, at its "
                                f"bound (max_queue_size {max_queue_size}); not accepted"
                                + (f" after waiting {timeout_s:g} s" if timeout_s > 0 else ""))
            time.sleep(min(pause_s, max(0.0, deadline - time.monotonic())))
            pause_s = min(pause_s * 2, self.poll_s[1])
