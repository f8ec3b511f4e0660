"""pytest plugin: kombu's Redis transport tests see the project's transport classes as kombu's."""

from __future__ import annotations

from typing import Any

import kombu.transport.redis as kombu_redis_module
import pytest
from kombu.utils import eventio

from asyncinfer.broker import transport as asyncinfer_transport

pytest_plugins = ["tests.kombu_upstream.kombu_conftest"]

REPLACED = ("Channel", "Transport", "SentinelChannel", "SentinelTransport", "QoS")

for _name in REPLACED:
    setattr(kombu_redis_module, _name, getattr(asyncinfer_transport, _name))


def _poll(*args: Any, **kwargs: Any) -> Any:
    # kombu's tests replace eventio.poll before they import the transport module; it was imported
    # here first, so it asks eventio for its poller at each call
    return eventio.poll(*args, **kwargs)


kombu_redis_module.poll = _poll


def pytest_configure(config: pytest.Config) -> None:
    for marker in ("replace_module_value", "ensured_modules", "masked_modules", "patched_module",
                   "sleepdeprived_patched_module", "stdouts"):
        config.addinivalue_line("markers", f"{marker}: kombu's test marker")


def pytest_report_header() -> str:
    return "kombu's Redis transport tests, on " + ", ".join(
        f"{getattr(kombu_redis_module, n).__module__}.{n}" for n in REPLACED)
