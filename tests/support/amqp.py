"""The RabbitMQ of the tests: 127.0.0.1:5672 (guest/guest, vhost ``/``) when one listens there.

A test on it skips when none listens, names its models after its run (``gated_<run>``...) so that
their queues are its own, and deletes those queues at the end (:func:`delete_queues`).
"""

from __future__ import annotations

import socket

__all__ = ["AMQP_HOST", "AMQP_PORT", "AMQP_URL", "rabbitmq_listens", "delete_queues"]

AMQP_HOST, AMQP_PORT = "127.0.0.1", 5672
AMQP_URL = f"amqp://guest:guest@{AMQP_HOST}:{AMQP_PORT}//"


def rabbitmq_listens() -> bool:
    """Whether something accepts connections at AMQP_HOST:AMQP_PORT."""
    try:
        with socket.create_connection((AMQP_HOST, AMQP_PORT), timeout=1.0):
            return True
    except OSError:
        return False


def delete_queues(queues: list[str]) -> None:
    """Delete these queues and their exchanges (one never declared is skipped)."""
    from kombu import Connection

    with Connection(AMQP_URL, connect_timeout=5) as conn:
        for name, delete in [(q, d) for q in queues for d in ("queue_delete", "exchange_delete")]:
            channel = conn.channel()
            try:
                getattr(channel, delete)(name)
            except conn.channel_errors:
                pass  # NOT_FOUND: never declared; the channel is closed by the server
            finally:
                try:
                    channel.close()
                except Exception:  # noqa: BLE001 - already closed by the error above
                    pass
