"""kombu connections of the app: on the project's kombu Redis transport for every Redis URL.

The app's :class:`~asyncinfer.config.celery_amqp.AMQP` makes each of its connections a
:class:`Connection`, which names its transport by import path (:mod:`asyncinfer.broker.transport`) for
``redis://``, ``rediss://`` and ``sentinel://`` URLs, failover alternates included, so that every
connection made from it (a clone, kombu's connection pools) gets the project's transport too; its
URL (``as_uri``, ``info``) still shows the scheme, as kombu's does.

On RabbitMQ each connection keeps what the broker last said of its publishes: RabbitMQ blocks a
connection that publishes while one of its resource alarms is raised (memory or disk), and says
so (``connection.blocked``, with its reason, "low on memory"; ``connection.unblocked`` once it
lifts). Nothing a blocked connection writes is read until then: a publish "succeeds" into a
socket buffer, and a large one waits until the write times out. :func:`publish_blocked` reads
what the broker sent and tells a sender whether to publish at all.
"""

from __future__ import annotations

import time
from typing import Any

from kombu import Connection as KombuConnection
from kombu.connection import ConnectionPool, PooledConnection

from asyncinfer.broker.cluster_backend import register_schemes

__all__ = ["Connection", "publish_blocked"]

_TRANSPORTS = "asyncinfer.broker.transport"

#: The project's transport (its import path) for each kombu transport name it replaces, and back.
_OURS: dict[str, str] = {"redis": f"{_TRANSPORTS}:Transport", "rediss": f"{_TRANSPORTS}:SecureTransport",
                         "sentinel": f"{_TRANSPORTS}:SentinelTransport",
                         "rediscluster": "asyncinfer.broker.cluster_transport:ClusterTransport",
                         "redisclusters": "asyncinfer.broker.cluster_transport:ClusterTransport"}
register_schemes()  # kombu resolves a URL's scheme before the connection's own parameters


class Connection(KombuConnection):  # type: ignore[misc]
    """kombu's connection, on the project's Redis transports (their import paths in
    ``transport_cls``; kombu's names in ``info`` and ``as_uri``)."""

    resolve_aliases = {**KombuConnection.resolve_aliases, **{v: k for k, v in _OURS.items()}}

    def _init_params(self, *args: Any, **kwargs: Any) -> None:
        super()._init_params(*args, **kwargs)
        if isinstance(self.transport_cls, str):
            self.transport_cls = _OURS.get(self.transport_cls, self.transport_cls)

    def Pool(self, limit: int | None = None, **kwargs: Any) -> Any:  # noqa: N802 - kombu's name
        return _ConnectionPool(self, limit=limit, **kwargs)

    def _establish_connection(self) -> Any:
        connection = super()._establish_connection()
        _BlockedState.watch(connection)
        return connection


class _BlockedState:
    """What RabbitMQ last said of a py-amqp connection's publishes: ``reason`` while blocked."""

    def __init__(self) -> None:
        self.reason: str | None = None

    @classmethod
    def of(cls, connection: Any) -> _BlockedState | None:
        return getattr(connection, "_asyncinfer_blocked", None)

    @classmethod
    def watch(cls, connection: Any) -> None:
        """Keep ``connection``'s state (a py-amqp connection; any other is left alone), the
        callbacks it was given still called."""
        import amqp
        from amqp import spec

        if not isinstance(connection, amqp.Connection):
            return
        callbacks, methods = connection._callbacks, connection._METHODS
        if not isinstance(callbacks, dict) or not isinstance(methods, dict):
            return  # a py-amqp that keeps them otherwise: as kombu gives it
        state = connection._asyncinfer_blocked = cls()
        given_blocked, given_unblocked = connection.on_blocked, connection.on_unblocked
        # py-amqp reads no argument of connection.blocked; its one field is the reason (shortstr)
        connection._METHODS = {**methods,
                               spec.Connection.Blocked: spec.method(spec.Connection.Blocked, "s")}

        def on_blocked(reason: str = "") -> None:
            state.reason = str(reason or "no reason given")
            if given_blocked is not None:
                given_blocked(state.reason)

        def on_unblocked() -> None:
            state.reason = None
            if given_unblocked is not None:
                given_unblocked()

        callbacks[spec.Connection.Blocked] = on_blocked
        callbacks[spec.Connection.Unblocked] = on_unblocked


def publish_blocked(connection: Any, wait_s: float = 0.0) -> str | None:
    """Why the broker blocks publishing on ``connection`` (a kombu connection) now — RabbitMQ's
    reason, "low on memory" or "low on disk" — after reading what it sent and waiting up to
    ``wait_s`` for the block to lift; None when it does not block it (or cannot say: not
    connected, not RabbitMQ, the connection failed: the publish finds out).

    RabbitMQ tells a connection only once it tried to publish during an alarm, so the first
    publish after an alarm is raised is written (and taken when it clears)."""
    amqp_connection = getattr(connection, "_connection", None)
    state = _BlockedState.of(amqp_connection)
    if state is None:
        return None
    deadline = time.monotonic() + max(0.0, wait_s)
    errors = tuple(connection.connection_errors) + tuple(connection.channel_errors)
    while True:
        try:
            # what the broker sent since (connection.blocked, .unblocked), without waiting
            # while it is not blocked; then until it lifts or the time is up
            timeout = 0.0 if state.reason is None else max(0.0, deadline - time.monotonic())
            connection.drain_events(timeout=timeout)
            continue
        except TimeoutError:
            pass
        except errors:
            return None  # the publish finds out, and reconnects
        if state.reason is None or time.monotonic() >= deadline:
            return state.reason


class _PooledConnection(PooledConnection, Connection):  # type: ignore[misc]
    """kombu's pooled connection, named by its URL's scheme as :class:`Connection` is."""


class _ConnectionPool(ConnectionPool):  # type: ignore[misc]
    """kombu's connection pool, of :class:`_PooledConnection`."""

    def new(self) -> Any:
        return _PooledConnection(self, **dict(self.connection._info(resolve=False)))
