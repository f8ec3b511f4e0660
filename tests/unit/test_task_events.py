"""The task events' flusher (worker/events.py) against a close that comes while it waits out its
pacing: it must end at once, not leave close() waiting on it for its whole join timeout (a worker
stopped 5 s late)."""

from __future__ import annotations

import threading
import time
import types

import pytest

from asyncinfer.celery_app import create_app
from asyncinfer.config.settings import Settings
from asyncinfer.worker import events
from asyncinfer.worker.events import TaskEvents

pytestmark = pytest.mark.timeout(30)

APP = create_app(Settings(broker_url="redis://127.0.0.1:1/0"))


def test_a_close_during_the_pacing_wait_ends_the_flusher(monkeypatch: pytest.MonkeyPatch) -> None:
    task_events = TaskEvents(APP, "w@h", enabled=False)  # no dispatcher: the flusher run by hand
    published: list[float] = []
    monkeypatch.setattr(task_events, "_publish", lambda: published.append(time.monotonic()))

    def close_meanwhile(seconds: float) -> None:  # what close() does before it joins the flusher
        task_events._closing = True
        task_events._due.set()

    monkeypatch.setattr(events, "time", types.SimpleNamespace(monotonic=time.monotonic,
                                                              sleep=close_meanwhile))
    # Given events published just now (the next publish waits out the interval), and more due
    task_events._flushed_at = time.monotonic()
    task_events._due.set()
    # When close() comes while the flusher waits out the interval
    flusher = threading.Thread(target=task_events._flush_paced, daemon=True)
    flusher.start()
    flusher.join(2)
    # Then the flusher ends (close() publishes what is left itself, once it has)
    assert not flusher.is_alive()
    assert published == []
