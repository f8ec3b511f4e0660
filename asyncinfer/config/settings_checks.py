"""The rules :class:`~asyncinfer.config.settings.Settings` are checked against when made: each
broken one is a ValueError that names the setting and the rule."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from asyncinfer.broker.urls import URL_EXAMPLES, is_cluster_url, is_redis_url, parse_cluster_url
from asyncinfer.config.loadable_factories import parse_patterns
from asyncinfer.config.model_options import parse_model_options
from asyncinfer.config.routes import parse_routes

__all__ = ["check_settings", "json_object", "TRACING_MODES", "MODEL_CONTROL_MODES"]

#: What ``ASYNCINFER_TRACING`` may say (asyncinfer/tracing).
TRACING_MODES = ("off", "otlp", "console", "global")
#: What ``ASYNCINFER_MODEL_CONTROL_MODE`` may say: Triton's ``--model-control-mode`` names, less
#: ``poll`` (a fleet has no repository folder to poll).
MODEL_CONTROL_MODES = ("none", "explicit")

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def check_settings(settings: Any) -> None:
    """Raise ValueError for the first setting of ``settings`` that breaks its rule."""
    for name, where in (("broker_url", "ASYNCINFER_BROKER_URL (or --broker-url)"),
                        ("result_backend", "ASYNCINFER_RESULT_BACKEND")):
        url = getattr(settings, name)
        if url and not _URL.match(url):
            shown = url if "@" not in url else "…@" + url.rsplit("@", 1)[1]  # no password
            raise ValueError(f"{where} is not a URL: {shown!r}; a URL looks like {URL_EXAMPLES}")
        if is_cluster_url(url):
            _check_cluster_url(url, where, settings)
    for name in ("task_serializer", "result_serializer"):
        if getattr(settings, name) not in ("json", "msgpack"):
            raise ValueError(f"{name} must be 'json' or 'msgpack', got {getattr(settings, name)!r}")
    if settings.consumer not in ("fast", "celery"):
        raise ValueError(f"consumer must be 'fast' or 'celery', got {settings.consumer!r}")
    if settings.tracing not in TRACING_MODES:
        raise ValueError(f"ASYNCINFER_TRACING must be one of {', '.join(TRACING_MODES)}, got "
                         f"{settings.tracing!r}")
    if settings.model_control_mode not in MODEL_CONTROL_MODES:
        raise ValueError(f"ASYNCINFER_MODEL_CONTROL_MODE (or --model-control-mode) must be one of "
                         f"{', '.join(MODEL_CONTROL_MODES)} (Triton's poll is not served), got "
                         f"{settings.model_control_mode!r}")
    parse_model_options(settings.model_options)  # raises ValueError when malformed
    parse_patterns(settings.loadable_factories)  # raises ValueError when malformed
    for route in parse_routes(settings.broker_routes):  # raises ValueError when malformed
        if not settings.result_backend and not is_redis_url(route.url):
            raise ValueError(
                f"ASYNCINFER_BROKER_ROUTES entry {route.pattern!r}: its broker is not Redis, "
                f"so ASYNCINFER_RESULT_BACKEND must name where results go")
    if settings.tensor_store_options:
        json_object(settings.tensor_store_options, "ASYNCINFER_TENSOR_STORE_OPTIONS")
    for name in ("concurrency", "prefetch_multiplier", "max_payload_bytes", "tensor_ref_bytes",
                 "tensor_store_max_bytes"):
        if int(getattr(settings, name)) < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {getattr(settings, name)!r}")
    for name in ("max_retries", "retry_budget_min", "submit_replicas", "max_worker_deaths",
                 "hold_batches"):
        if int(getattr(settings, name)) < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {getattr(settings, name)!r}")
    if settings.submit_replicas and not settings.submit_replicas_timeout_s > 0:
        raise ValueError("submit_replicas_timeout_s must be > 0 when submit_replicas is set "
                         f"(WAIT 0 would wait forever), got {settings.submit_replicas_timeout_s!r}")
    if settings.retry_budget_window_s <= 0:
        raise ValueError(f"retry_budget_window_s must be > 0, got {settings.retry_budget_window_s!r}")
    if 0 < settings.visibility_timeout_s <= settings.time_limit_s:
        raise ValueError(
            f"time_limit_s ({settings.time_limit_s}) must be below visibility_timeout_s "
            f"({settings.visibility_timeout_s}): a request still running would be redelivered")
    if 0 < settings.lease_s < 1:
        raise ValueError(f"lease_s must be 0 (no leases) or at least 1 second (it is renewed "
                         f"every third of it), got {settings.lease_s!r}")
    for name in ("visibility_timeout_s", "result_expires_s", "connect_timeout_s", "lease_s",
                 "hold_s",
                 "soft_time_limit_s", "time_limit_s", "retry_backoff_s", "retry_backoff_max_s",
                 "retry_budget_ratio", "retry_budget_window_s", "submit_timeout_s",
                 "submit_replicas_timeout_s", "lost_after_s", "hang_after_s"):
        value = float(getattr(settings, name))
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {getattr(settings, name)!r}")
    if not 0 <= float(settings.refill_fraction) < 1:
        raise ValueError(f"refill_fraction must be a number in [0, 1), got {settings.refill_fraction!r}")
    for name in ("gateway_header_timeout_s", "gateway_body_timeout_s"):
        value = float(getattr(settings, name))
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number of seconds > 0, got "
                             f"{getattr(settings, name)!r}")
    if settings.gateway_max_connections < 0:
        raise ValueError(f"gateway_max_connections must be >= 0 (0: from the open-files limit), "
                         f"got {settings.gateway_max_connections!r}")
    if settings.gateway_processes < 0:
        raise ValueError(f"gateway_processes must be >= 0 (0: one process, no shared ports), "
                         f"got {settings.gateway_processes!r}")


def json_object(text: str, what: str) -> dict[str, Any]:
    """``text`` read as a JSON object (ValueError naming ``what`` when it is not one)."""
    try:
        found = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} must be a JSON object: {exc}") from None
    if not isinstance(found, dict):
        raise ValueError(f"{what} must be a JSON object, got {text!r:.80}")
    return found


def _check_cluster_url(url: str, where: str, settings: Any) -> None:
    """A Redis Cluster URL is read by asyncinfer's own consumer (kombu's event loop does not
    follow a slot)."""
    parse_cluster_url(url)  # raises ValueError naming the rule broken
    if settings.consumer != "fast":
        raise ValueError(f"{where}: on a Redis Cluster the workers consume with asyncinfer's own "
                         "consumer (ASYNCINFER_CONSUMER=fast), not Celery's")
