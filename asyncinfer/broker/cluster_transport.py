"""kombu's transport on a shard of a Redis Cluster (``rediscluster://`` and ``redisclusters://``
URLs): the project's Redis transport (transport.py), its connections a shard's (cluster_client.py).
Registered under those schemes by cluster_backend.py's :func:`register_schemes`.

On a URL that spreads requests over N shards (``&shards=N``, no ``shard``), a task is published
on the shard its ID falls in (shards.py's :func:`request_shard`), where the workers take it and
store its result; everything else of the channel (its consumers, pidbox, events) is shard 0's.
"""

from __future__ import annotations

import threading
from typing import Any

from kombu.utils import json as kombu_json

from asyncinfer.broker.celery_claims import CeleryClaims, claims_on
from asyncinfer.broker.shards import request_shard
from asyncinfer.broker.transport import REFUSING_PARSER, Channel, Transport, answering
from asyncinfer.broker.urls import parse_cluster_url

__all__ = ["ClusterChannel", "ClusterTransport"]


#: kombu's connection settings that a cluster shard's connections take as they are.
_SHARD_PARAMS = ("socket_timeout", "socket_connect_timeout", "socket_keepalive",
                 "socket_keepalive_options", "health_check_interval", "retry_on_timeout",
                 "client_name", "max_connections")


class ClusterChannel(Channel):
    """:class:`Channel` on a shard of a Redis Cluster (``rediscluster://`` URLs,
    broker/cluster_client.py): its keys in the shard's hash slot, on the slot's master."""

    def _get_pool(self, asynchronous: bool = False) -> Any:
        from asyncinfer.broker.cluster_client import shard_client

        params = {k: getattr(self, k, None) for k in _SHARD_PARAMS}
        pool = shard_client(self.connection.client.hostname, parser_class=REFUSING_PARSER,
                            **{k: v for k, v in params.items() if v is not None}).connection_pool
        if asynchronous:  # as kombu's: a connection that drops leaves the channel's poller
            channel, shard_connection = self, pool.connection_class

            class Connection(shard_connection):  # type: ignore[misc, valid-type]
                def disconnect(self, *args: Any, **kwargs: Any) -> None:
                    super().disconnect(*args, **kwargs)
                    if channel._registered:
                        channel._on_connection_disconnect(self)

            pool.connection_class = Connection
        return pool

    def _get_client(self) -> Any:
        from asyncinfer.broker.cluster_client import ShardClient

        return answering(ShardClient)

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        """kombu's publish, on the shard of the task's ID when the URL spreads requests."""
        shard = self._shard_of(message)
        if shard == 0:
            return super()._put(queue, message, **kwargs)
        client, claims = self._shard(shard)
        priority = self._get_message_priority(message, reverse=False)
        text = kombu_json.dumps(message)
        if not (claims_on(self, queue, message)
                and claims.put(client, queue, message, text, priority)):
            client.lpush(self._q_for_pri(queue, priority), text)
        return None

    def _shard_of(self, message: Any) -> int:
        spread = getattr(self, "_spread_over", None)
        if spread is None:
            parsed = parse_cluster_url(self.connection.client.hostname)
            spread = self._spread_over = parsed.shards if parsed.spread else 1
        headers = message.get("headers") if isinstance(message, dict) else None
        task_id = headers.get("id") if isinstance(headers, dict) else None
        return request_shard(task_id, spread) if spread > 1 and isinstance(task_id, str) else 0

    def _shard(self, shard: int) -> tuple[Any, CeleryClaims]:
        """Shard ``shard``'s client and its claims (made on first use)."""
        lock = self.__dict__.setdefault("_shards_lock", threading.Lock())
        with lock:
            shards = self.__dict__.setdefault("_shards", {})
            found = shards.get(shard)
            if found is None:
                from asyncinfer.broker.cluster_client import shard_client

                params = {k: getattr(self, k, None) for k in _SHARD_PARAMS}
                client = shard_client(self.connection.client.hostname, shard,
                                      **{k: v for k, v in params.items() if v is not None})
                found = shards[shard] = (client, CeleryClaims(
                    client, float(self.claim_ttl_s or 86400)))
            return found  # type: ignore[no-any-return]


class ClusterTransport(Transport):
    """:class:`Transport` for ``rediscluster://`` and ``redisclusters://`` URLs: it reads the URL
    itself (kombu would refuse its options, ``nodes`` and ``shards``)."""

    Channel = ClusterChannel
    can_parse_url = True
