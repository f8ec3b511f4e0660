"""Every Redis key and channel name asyncinfer reads or writes, in one place.

Celery's and kombu's own names (results, the unacknowledged bookkeeping) are here too, because
the fast consumer and the result writer speak them directly. The queues themselves are the wire
contract's (``infer.<model>``, constants.py).
"""

from __future__ import annotations

__all__ = [
    "KEY_PREFIX",
    "RESULT_KEY_PREFIX",
    "UNACKED_KEY",
    "UNACKED_INDEX_KEY",
    "CLAIM_PREFIX",
    "TRACES_KEY",
    "DEAD_LETTER_PREFIX",
    "RESPONSE_CACHE_PREFIX",
    "response_cache_index_key",
    "response_cache_stats_key",
    "response_cache_generation_key",
    "RETRY_BUDGET_PREFIX",
    "REPLICATION_MARK_CHANNEL",
    "REPLY_CHANNEL_PREFIX",
    "dead_letter_key",
    "CATALOGUE_LIVE_KEY",
    "CATALOGUE_HOSTS_KEY",
    "CATALOGUE_KNOWN_KEY",
    "CATALOGUE_META_KEY",
    "LEASES_KEY",
    "LEASE_HOLDERS_KEY",
    "LEASE_DEVICE_KEY",
    "DEATHS_PREFIX",
    "HUNG_PREFIX",
    "RECLAIMED_PREFIX",
    "WATCH_PREFIX",
    "BELL_PREFIX",
    "WAITERS_SUFFIX",
    "STATS_PREFIX",
    "STATS_INDEX_KEY",
    "STREAM_PREFIX",
    "SEQUENCE_PREFIX",
    "SEQUENCE_MODELS_KEY",
    "sequence_pin_key",
    "sequence_workers_key",
    "JOB_PREFIX",
]

#: Every key asyncinfer itself writes starts with this.
KEY_PREFIX = "asyncinfer:"

#: Celery's Redis result backend stores each result under this prefix + request ID, and
#: publishes it on a channel of the same name.
RESULT_KEY_PREFIX = "celery-task-meta-"

#: kombu's Redis transport bookkeeping of unacknowledged messages (its defaults): a hash of
#: delivery tag → ``[envelope, exchange, routing_key]`` and a sorted set of tag → time taken.
UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"

#: A caller-chosen request ID claimed at submit (idempotency); the value is the queue it went to.
CLAIM_PREFIX = KEY_PREFIX + "request:"
#: The traces of requests with generated IDs, while they are in flight: a hash of request ID →
#: the queue it went to, written with its push and removed when its result (any state) is
#: stored (client/lost_check.py reads "no result and no trace" as "the broker lost it").
TRACES_KEY = KEY_PREFIX + "traces"

#: Leases of taken requests (broker/leases.py): ``…:leases`` sorted set of delivery tag →
#: the lease's expiry (Redis' clock, seconds); ``…:leases:holders`` hash of tag → the holding
#: process and the list the message came from; ``…:leases:device`` hash of tag → request ID while
#: the request's batch is on the device (a death then counts against it).
LEASES_KEY = KEY_PREFIX + "leases"
LEASE_HOLDERS_KEY = LEASES_KEY + ":holders"
LEASE_DEVICE_KEY = LEASES_KEY + ":device"

#: Worker deaths while a request was on the device: ``asyncinfer:deaths:<request id>`` (a count).
DEATHS_PREFIX = KEY_PREFIX + "deaths:"
#: + request ID: the line of the last hang of a device while the request was on it (it lives as
#: long as the death counts; policy/hangs.py).
HUNG_PREFIX = KEY_PREFIX + "hung:"
#: + delivery tag: the message went back to its queue from a lease that expired or a dead holder
#: (it lives as long as the death counts). A renewal that finds no holder for a tag it holds
#: tells by it whether the message went back (it runs there) or Redis forgot it (a restart
#: without its data, a failover to a replica behind: the holder takes it again, broker/leases.py).
RECLAIMED_PREFIX = KEY_PREFIX + "reclaimed:"

#: The one idle consumer watching a list (wake.py): ``asyncinfer:watch:<list>`` names it, with a
#: short TTL; ``asyncinfer:bell:<list>`` (at most one element) wakes one of the other idle ones.
#: ``asyncinfer:bell:<list>:waiters`` counts the consumers waiting for that bell.
WATCH_PREFIX = KEY_PREFIX + "watch:"
BELL_PREFIX = KEY_PREFIX + "bell:"
WAITERS_SUFFIX = ":waiters"

#: Requests of model ``M`` that failed for good (when ``M`` opts in): the list ``asyncinfer:dead:M``.
DEAD_LETTER_PREFIX = KEY_PREFIX + "dead:"

#: The fleet's retry budget: ``…:requests:<window>`` and ``…:retries:<window>`` counters.
RETRY_BUDGET_PREFIX = KEY_PREFIX + "retry-budget"

#: Published (and replicated) before ``WAIT``, so the wait covers writes of every connection.
REPLICATION_MARK_CHANNEL = KEY_PREFIX + "replicated"

#: A client's reply channel: ``asyncinfer:reply:<client>``. A request whose ``asyncinfer_reply_to``
#: header names one has its final result published there as well as on its result key's channel,
#: so a client subscribes once, not once per request (wire/reply.py).
REPLY_CHANNEL_PREFIX = KEY_PREFIX + "reply:"


def dead_letter_key(model: str) -> str:
    """The dead-letter list of ``model`` (see dead_letters.py)."""
    return DEAD_LETTER_PREFIX + model


#: The response cache (broker/response_cache.py): ``…entry:<name>:<sha256>:<weights>`` one cached
#: answer (a string with a TTL; ``<name>`` the model, or ``<model>@<version>`` for a request naming a
#: version; ``<weights>`` the token of the weights that computed it); ``…generation:<name>`` the
#: token of the weights such requests are answered with now (no TTL; set and removed by the workers'
#: loads and unloads); ``…index:<model>`` sorted set of the model's entries by write time (its size
#: bound); ``…stats:<model>`` hash of ``hits`` and ``misses``.
RESPONSE_CACHE_PREFIX = KEY_PREFIX + "cache:"


def response_cache_index_key(model: str) -> str:
    """The sorted set of ``model``'s cached answers, by the time each was written."""
    return RESPONSE_CACHE_PREFIX + "index:" + model


def response_cache_stats_key(model: str) -> str:
    """The hash of ``model``'s cache hits and misses."""
    return RESPONSE_CACHE_PREFIX + "stats:" + model


def response_cache_generation_key(name: str) -> str:
    """The token of the weights that answer ``name``'s requests now (``name``: a model, for the
    requests naming no version; ``model@version`` for those naming one)."""
    return RESPONSE_CACHE_PREFIX + "generation:" + name



#: The model catalogue (broker/catalogue.py): which worker hosts which model, live and recently.
#: ``…:live`` sorted set of ``model\tworker`` → expiry time; ``…:hosts`` hash of the same member →
#: JSON of that worker's device; ``…:known`` sorted set of model → last announced; ``…:meta``
#: hash of model → JSON metadata (inputs, outputs, versions, max batch size).
CATALOGUE_PREFIX = KEY_PREFIX + "models:"
CATALOGUE_LIVE_KEY = CATALOGUE_PREFIX + "live"
CATALOGUE_HOSTS_KEY = CATALOGUE_PREFIX + "hosts"
CATALOGUE_KNOWN_KEY = CATALOGUE_PREFIX + "known"
CATALOGUE_META_KEY = CATALOGUE_PREFIX + "meta"

#: The fleet's inference statistics (broker/fleet_stats.py): ``asyncinfer:stats:<model>:<worker>`` hash of
#: one worker's counts of one model; ``asyncinfer:stats:index`` set of ``model\tworker``.
STATS_PREFIX = KEY_PREFIX + "stats:"
STATS_INDEX_KEY = STATS_PREFIX + "index"

#: A streaming request's parts (wire/stream.py): the Redis Stream ``asyncinfer:stream:<request id>``
#: on the result backend's Redis.
STREAM_PREFIX = KEY_PREFIX + "stream:"


#: Sequence batching (worker/requests/sequence_pins.py, broker/publisher.py):
#: ``asyncinfer:sequence:pin:<model>:<u|s><id>`` the worker a live sequence is pinned to (its
#: registry member, below; TTL the model's sequence timeout, refreshed by each request's push);
#: ``asyncinfer:sequence:workers:<model>`` sorted set of the workers serving the model's sequences
#: (member ``list\tholder\ttimeout_s``: the worker's own list, its lease holder and the model's
#: sequence timeout) → until when it lives (Redis' clock, renewed while it lives);
#: ``asyncinfer:sequence:models`` the set of models that have such a sorted set.
SEQUENCE_PREFIX = KEY_PREFIX + "sequence:"
SEQUENCE_MODELS_KEY = SEQUENCE_PREFIX + "models"


def sequence_pin_key(model: str, key: str) -> str:
    """The pin of ``model``'s sequence ``key`` (wire/sequence.py: ``u1000``, ``sabc``)."""
    return f"{SEQUENCE_PREFIX}pin:{model}:{key}"


def sequence_workers_key(model: str) -> str:
    """The sorted set of the workers serving ``model``'s sequences."""
    return f"{SEQUENCE_PREFIX}workers:{model}"

#: A job over a file (asyncinfer/client/jobs): a hash of its model, files, counts and state, by job ID.
JOB_PREFIX = KEY_PREFIX + "job:"
