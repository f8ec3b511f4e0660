"""The Celery configuration derived from :class:`~asyncinfer.config.settings.Settings`."""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from asyncinfer.broker.cluster_backend import register_schemes
from asyncinfer.broker.connections import sentinel_kwargs
from asyncinfer.broker.urls import is_sentinel_url, normalized_url
from asyncinfer.config.settings import Settings

__all__ = ["celery_config", "ACCEPT_CONTENT", "redis_ssl_options"]

#: What workers and clients deserialize. Never pickle.
ACCEPT_CONTENT = ["json", "msgpack"]


_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}
_SSL_KEYS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def redis_ssl_options(url: str) -> dict[str, Any] | None:
    """kombu's ``broker_use_ssl`` for a ``rediss://`` URL, from its query (``ssl_cert_reqs=required
    &ssl_ca_certs=/ca.pem``, as redis-py and Celery's backend read it); None for other URLs.

    kombu ignores the query of a ``rediss://`` broker URL and would connect without verifying
    the server; without ``ssl_cert_reqs`` the certificate is required.
    """
    parts = urlsplit(url)
    if parts.scheme != "rediss":
        return None
    query = dict(parse_qsl(parts.query))
    reqs = query.get("ssl_cert_reqs", "required")
    cert_reqs = _CERT_REQS.get(reqs.lower().removeprefix("cert_"))
    if cert_reqs is None:
        raise ValueError(f"ssl_cert_reqs must be required, optional or none, got {reqs!r} in {url}")
    options: dict[str, Any] = {"ssl_cert_reqs": cert_reqs}
    options.update({key: query[key] for key in _SSL_KEYS if query.get(key)})
    return options


def _with_sentinel(transport: dict[str, Any], url: str, settings: Settings) -> dict[str, Any]:
    """``transport`` plus, for a ``sentinel://`` URL, the master's name and the Sentinels' own
    connection arguments, as kombu's Sentinel transport and Celery's SentinelBackend read them."""
    options = dict(transport)
    if is_sentinel_url(url):
        options["master_name"] = settings.sentinel_master
        own = sentinel_kwargs(settings)
        if own:
            options["sentinel_kwargs"] = own
    return options


def celery_config(settings: Settings) -> dict[str, Any]:
    """Return the Celery settings for ``settings``: safe serializers, late acks, expiry."""
    # kombu sweeps for unacknowledged messages older than the visibility timeout only every
    # interval × throttle seconds (100 s by default): sweep at least every half timeout instead.
    transport = {"visibility_timeout": settings.visibility_timeout_s,
                 "unacked_restore_interval": max(1, min(10, int(settings.visibility_timeout_s / 2))),
                 "unacked_restore_throttle": 1,
                 # a sweeper killed mid-sweep must not block every other sweep for 5 minutes
                 "unacked_mutex_expire": 30}
    register_schemes()  # rediscluster:// for Celery's result backends and kombu's transports
    broker_url = normalized_url(settings.resolved_broker_url())
    backend_url = normalized_url(settings.resolved_result_backend())
    broker_tls, backend_tls = redis_ssl_options(broker_url), redis_ssl_options(backend_url)
    return {
        **({"broker_use_ssl": broker_tls} if broker_tls else {}),
        **({"redis_backend_use_ssl": backend_tls} if backend_tls else {}),
        "broker_url": broker_url,
        "result_backend": backend_url,
        # a producer's asyncinfer.infer claims its task ID for as long as a result lives
        # (broker/celery_claims.py)
        "broker_transport_options": _with_sentinel(
            {**transport, "claim_ttl_s": settings.result_expires_s}, broker_url, settings),
        "result_backend_transport_options": _with_sentinel(transport, backend_url, settings),
        "broker_connection_retry_on_startup": True,
        "broker_connection_timeout": settings.connect_timeout_s,
        "task_serializer": settings.task_serializer,
        "result_serializer": settings.result_serializer,
        "accept_content": list(ACCEPT_CONTENT),
        "result_accept_content": list(ACCEPT_CONTENT),
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_track_started": True,
        "task_create_missing_queues": True,
        "result_expires": settings.result_expires_s,
        # Celery's own names; its prefork pool enforces them, our device workers honour them.
        "task_time_limit": settings.time_limit_s or None,
        "task_soft_time_limit": settings.soft_time_limit_s or None,
        "worker_pool": "threads",
        "worker_send_task_events": settings.send_events,
        "worker_concurrency": settings.concurrency,
        "worker_prefetch_multiplier": settings.prefetch_multiplier,
        "worker_consumer": "asyncinfer.worker.celery_consumer:Consumer",
        "worker_hijack_root_logger": True,
        "worker_redirect_stdouts": False,
    }
