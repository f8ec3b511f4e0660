"""The Celery configuration derived from :class:`~asyncinfer.config.settings.Settings`."""

from __future__ import annotations

from typing import Any

from asyncinfer.config.settings import Settings

__all__ = ["celery_config", "ACCEPT_CONTENT"]

#: What workers and clients deserialize. Never pickle.
ACCEPT_CONTENT = ["json", "msgpack"]


def celery_config(settings: Settings) -> dict[str, Any]:
    """Return the Celery settings for ``settings``: safe serializers, late acks, expiry."""
    # kombu sweeps for unacknowledged messages older than the visibility timeout only every
    # interval × throttle seconds (100 s by default): sweep at least every half timeout instead.
    transport = {"visibility_timeout": settings.visibility_timeout_s,
                 "unacked_restore_interval": max(1, min(10, int(settings.visibility_timeout_s / 2))),
                 "unacked_restore_throttle": 1,
                 # a sweeper killed mid-sweep must not block every other sweep for 5 minutes
                 "unacked_mutex_expire": 30}
    return {
        "broker_url": settings.resolved_broker_url(),
        "result_backend": settings.resolved_result_backend(),
        "broker_transport_options": transport,
        "result_backend_transport_options": dict(transport),
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
        "worker_pool": "threads",
        "worker_concurrency": settings.concurrency,
        "worker_prefetch_multiplier": settings.prefetch_multiplier,
        "worker_consumer": "asyncinfer.workers.consumer:Consumer",
        "worker_hijack_root_logger": True,
        "worker_redirect_stdouts": False,
    }
