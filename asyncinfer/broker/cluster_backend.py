"""Celery's Redis result backend on a Redis Cluster (``rediscluster://`` result backend URLs).

Celery's own backend speaks to one Redis. This one is Celery's, with its client a shard's
(cluster_client.py): every result key, its channel and its chord keys are where the fleet's
workers write them, in the shard's hash slot, and ``AsyncResult(id).get()`` waits on them as it
does on one Redis. Registered under the schemes ``rediscluster`` and ``redisclusters`` when
asyncinfer is imported (:func:`register_schemes`), so a Celery app configured with
``result_backend = "rediscluster://host:7000/?nodes=host2:7000"`` finds it.
"""

from __future__ import annotations

from typing import Any

from celery.backends.redis import RedisBackend

from asyncinfer.broker.urls import CLUSTER_SCHEMES, parse_cluster_url

__all__ = ["ClusterBackend", "register_schemes"]

#: Celery's connection settings that a shard's connections take as they are.
_PASSED = ("socket_timeout", "socket_connect_timeout", "retry_on_timeout", "client_name",
           "health_check_interval", "socket_keepalive", "max_connections")


class ClusterBackend(RedisBackend):  # type: ignore[misc]
    """Celery's Redis result backend on one shard of a Redis Cluster."""

    cluster_url = ""

    def _params_from_url(self, url: str, defaults: dict[str, Any]) -> dict[str, Any]:
        parse_cluster_url(url)  # a malformed URL says so now, not at the first result
        self.cluster_url = url
        return {k: v for k, v in defaults.items() if k in _PASSED and v is not None}

    def _create_client(self, **params: Any) -> Any:
        from asyncinfer.broker.cluster_client import shard_client

        return shard_client(self.cluster_url, **{k: v for k, v in params.items()
                                                   if k in _PASSED and v is not None})


def register_schemes() -> None:
    """Make Celery and kombu find the cluster's result backend and transport by URL scheme."""
    from celery.app import backends
    from kombu.transport import TRANSPORT_ALIASES

    for scheme in CLUSTER_SCHEMES:
        backends.BACKEND_ALIASES.setdefault(scheme, f"{__name__}:ClusterBackend")
        TRANSPORT_ALIASES.setdefault(scheme, "asyncinfer.broker.cluster_transport:ClusterTransport")
