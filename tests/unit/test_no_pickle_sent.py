"""The asyncinfer app never publishes pickle, whatever serializer a signature's options name."""

from __future__ import annotations

from typing import Any

import pytest

from asyncinfer.celery_app import create_app
from asyncinfer.config.settings import Settings


class _Producer:
    """Records what Celery would publish (no broker)."""

    def __init__(self) -> None:
        self.published: list[dict[str, Any]] = []
        self.connection = None

    def publish(self, body: Any, **kwargs: Any) -> None:
        self.published.append(kwargs)


@pytest.mark.parametrize(("asked", "sent"), [("pickle", "json"), ("yaml", "json"),
                                             ("msgpack", "msgpack"), ("json", "json"),
                                             (None, "json")])
def test_a_task_message_is_sent_as_json_or_msgpack_only(asked: str | None, sent: str) -> None:
    app = create_app(Settings(broker_url="redis://127.0.0.1:1/0"))
    message = app.amqp.create_task_message("r1", "cb.task", (1,), {})
    producer = _Producer()
    app.amqp.send_task_message(producer, "cb.task", message, serializer=asked, declare=[],
                               routing_key="cb", exchange="", retry=False)
    assert [p["serializer"] for p in producer.published] == [sent]


def test_the_benchs_plain_celery_app_never_sends_pickle_either() -> None:
    from asyncinfer.ops.benchmark.baseline import app

    message = app.amqp.create_task_message("r1", "cb.task", (1,), {})
    producer = _Producer()
    app.amqp.send_task_message(producer, "cb.task", message, serializer="pickle", declare=[],
                               routing_key="cb", exchange="", retry=False)
    assert [p["serializer"] for p in producer.published] == ["json"]
