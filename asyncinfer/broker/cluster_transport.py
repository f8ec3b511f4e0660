"""kombu's transport on a shard of a Redis Cluster (``rediscluster://`` and ``redisclusters://``
URLs): the project's Redis transport (transport.py), its connections a shard's (cluster_client.py).
Registered under those schemes by cluster_backend.py's :func:`register_schemes`."""

from __future__ import annotations

from typing import Any

from asyncinfer.broker.transport import REFUSING_PARSER, Channel, Transport, answering

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


class ClusterTransport(Transport):
    """:class:`Transport` for ``rediscluster://`` and ``redisclusters://`` URLs: it reads the URL
    itself (kombu would refuse its options, ``nodes`` and ``shards``)."""

    Channel = ClusterChannel
    can_parse_url = True
