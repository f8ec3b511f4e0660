"""Celery's consumer hands the pipeline's messages over once per turn of kombu's event loop
(worker/celery_consumer.py): what a lost connection's loop delivered and never handed over (kombu's
hub drops the callbacks after one that raises as it closes) is handed over when the loss is
seen, and what the next connection delivers is handed over again."""

from __future__ import annotations

from typing import Any

from asyncinfer.celery_app import create_app
from asyncinfer.config.settings import Settings
from asyncinfer.worker.celery_consumer import Consumer


class _Hub:
    """kombu's hub as the hand-over uses it: callbacks run at the end of the loop's turn."""

    def __init__(self) -> None:
        self.ready: list[Any] = []

    def call_soon(self, callback: Any, *args: Any) -> None:
        self.ready.append(callback)

    def run(self) -> None:
        ready, self.ready = self.ready, []
        for callback in ready:
            callback()

    def close_dropping_callbacks(self) -> None:
        self.ready = []  # as Hub._close after a callback that raised


class _Pipeline:
    def __init__(self) -> None:
        self.handed: list[list[str]] = []

    def received(self, messages: list[str]) -> None:
        self.handed.append(list(messages))


def _consumer() -> tuple[Consumer, _Hub, _Pipeline]:
    consumer = Consumer.__new__(Consumer)
    hub, pipeline = _Hub(), _Pipeline()
    consumer.app = create_app(Settings.from_env({"ASYNCINFER_BROKER_URL": "redis://127.0.0.1:1/0"}))
    consumer.hub = hub
    consumer.connection = None
    consumer.app.conf.worker_enable_prefetch_count_reduction = False  # no Celery QoS here
    consumer._pipeline = lambda: pipeline  # type: ignore[method-assign]
    return consumer, hub, pipeline


def test_a_turns_messages_are_handed_over_together_at_its_end() -> None:
    consumer, hub, pipeline = _consumer()
    consumer._hand_over("m1")
    consumer._hand_over("m2")
    assert pipeline.handed == [] and len(hub.ready) == 1
    hub.run()
    assert pipeline.handed == [["m1", "m2"]]


def test_what_a_lost_loop_never_handed_over_goes_at_the_loss_and_the_next_turns_go_too() -> None:
    consumer, hub, pipeline = _consumer()
    # Given messages delivered in the turn that met the dead socket, their hand-over dropped
    consumer._hand_over("old-1")
    consumer._hand_over("old-2")
    hub.close_dropping_callbacks()
    # When Celery's consumer sees the connection lost
    consumer.on_connection_error_after_connected(OSError("Server unexpectedly closed connection"))
    # Then they are handed over (on RabbitMQ the pipeline gives them up at once: the broker
    # gives them back) before the consumer connects again
    assert pipeline.handed == [["old-1", "old-2"]]
    # And what the next connection delivers is handed over at the end of its turn
    consumer._hand_over("new-1")
    assert len(hub.ready) == 1
    hub.run()
    assert pipeline.handed == [["old-1", "old-2"], ["new-1"]]
