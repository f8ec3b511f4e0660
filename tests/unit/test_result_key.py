"""A request's result key spelled as Celery's backend spells it (client/result_watcher.py)."""

from __future__ import annotations

import pytest
from celery import Celery

from asyncinfer.client.result_watcher import result_key_prefix


@pytest.mark.parametrize("options", [{}, {"global_keyprefix": "tenant-a"}])
def test_the_prefix_and_the_id_are_the_backends_key(options: dict[str, str]) -> None:
    app = Celery(broker="redis://127.0.0.1:1/0", backend="redis://127.0.0.1:1/0")
    app.conf.result_backend_transport_options = options
    backend = app.backend  # made without connecting
    for request_id in ("3f1c2a9e-0000-4000-8000-000000000001", "caller-chosen id/1", "é"):
        expected = backend.get_key_for_task(request_id)
        expected = expected.decode() if isinstance(expected, bytes) else expected
        assert result_key_prefix(backend) + request_id == expected
    assert result_key_prefix(backend).startswith(options.get("global_keyprefix", "celery-task-meta-"))
