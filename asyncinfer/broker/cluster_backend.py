"""Celery's Redis result backend on a Redis Cluster (``rediscluster://`` result backend URLs).

Celery's own backend speaks to one Redis. This one is Celery's, with its client a shard's
(cluster_client.py): every result key, its channel and its chord keys are where the fleet's
workers write them, in the shard's hash slot, and ``AsyncResult(id).get()`` waits on them as it
does on one Redis. Registered under the schemes ``rediscluster`` and ``redisclusters`` when
asyncinfer is imported (:func:`register_schemes`), so a Celery app configured with
``result_backend = "rediscluster://host:7000/?nodes=host2:7000"`` finds it.

On a URL that spreads requests over N shards (``&shards=N``, no ``shard``), a task's result is
read and written on the shard its ID falls in (shards.py's :func:`request_shard`), where the
workers store it; anything else (groups, chords) on shard 0. Its waits subscribe on shard 0's
node: a cluster hands every PUBLISH to every node.
"""

from __future__ import annotations

import threading
from typing import Any

from celery.backends.redis import RedisBackend

from asyncinfer.broker.shards import request_shard
from asyncinfer.broker.urls import CLUSTER_SCHEMES, parse_cluster_url

__all__ = ["ClusterBackend", "register_schemes"]

#: Celery's connection settings that a shard's connections take as they are.
_PASSED = ("socket_timeout", "socket_connect_timeout", "retry_on_timeout", "client_name",
           "health_check_interval", "socket_keepalive", "max_connections")


class ClusterBackend(RedisBackend):  # type: ignore[misc]
    """Celery's Redis result backend on one shard of a Redis Cluster."""

    cluster_url = ""
    #: Shards a spread URL's requests fall in (1: the URL's one shard).
    spread_over = 1

    def _params_from_url(self, url: str, defaults: dict[str, Any]) -> dict[str, Any]:
        parsed = parse_cluster_url(url)  # a malformed URL says so now, not at the first result
        self.cluster_url = url
        self.spread_over = parsed.shards if parsed.spread else 1
        self._params: dict[str, Any] = {}
        self._shard_clients: dict[int, Any] = {}
        self._shards_lock = threading.Lock()
        return {k: v for k, v in defaults.items() if k in _PASSED and v is not None}

    def _create_client(self, **params: Any) -> Any:
        from asyncinfer.broker.cluster_client import shard_client

        self._params = {k: v for k, v in params.items() if k in _PASSED and v is not None}
        return shard_client(self.cluster_url, **self._params)

    def _client_of(self, key: Any) -> Any:
        """The client of the shard that holds ``key``: a task's result on its ID's shard (a
        spread URL), anything else on the URL's."""
        if self.spread_over == 1:
            return self.client
        text = key.decode() if isinstance(key, bytes) else str(key)
        prefix = self.task_keyprefix  # bytes, as Celery keeps it
        prefix = prefix.decode() if isinstance(prefix, bytes) else str(prefix)
        if not text.startswith(prefix):
            return self.client
        shard = request_shard(text[len(prefix):], self.spread_over)
        if shard == 0:
            return self.client
        with self._shards_lock:
            client = self._shard_clients.get(shard)
            if client is None:
                from asyncinfer.broker.cluster_client import shard_client

                self.client  # noqa: B018 - its parameters first
                client = self._shard_clients[shard] = shard_client(self.cluster_url, shard,
                                                                   **self._params)
        return client

    def get(self, key: Any) -> Any:
        return self._client_of(key).get(key)

    def mget(self, keys: Any) -> Any:
        if self.spread_over == 1:
            return self.client.mget(keys)
        return [self._client_of(key).get(key) for key in keys]

    def _set(self, key: Any, value: Any, expires: Any = None) -> None:
        if expires is None:
            expires = self.expires
        with self._client_of(key).pipeline() as pipe:
            if expires:
                pipe.setex(key, expires, value)
            else:
                pipe.set(key, value)
            pipe.publish(key, value)
            pipe.execute()

    def delete(self, key: Any) -> None:
        self._client_of(key).delete(key)


def register_schemes() -> None:
    """Make Celery and kombu find the cluster's result backend and transport by URL scheme."""
    from celery.app import backends
    from kombu.transport import TRANSPORT_ALIASES

    for scheme in CLUSTER_SCHEMES:
        backends.BACKEND_ALIASES.setdefault(scheme, f"{__name__}:ClusterBackend")
        TRANSPORT_ALIASES.setdefault(scheme, "asyncinfer.broker.cluster_transport:ClusterTransport")
