"""kombu connections of the app: on the project's kombu Redis transport for every Redis URL.

The app's :class:`~asyncinfer.config.celery_amqp.AMQP` makes each of its connections a
:class:`Connection`, which names its transport by import path (:mod:`asyncinfer.broker.transport`) for
``redis://``, ``rediss://`` and ``sentinel://`` URLs, failover alternates included, so that every
connection made from it (a clone, kombu's connection pools) gets the project's transport too; its
URL (``as_uri``, ``info``) still shows the scheme, as kombu's does.
"""

from __future__ import annotations

from typing import Any

from kombu import Connection as KombuConnection
from kombu.connection import ConnectionPool, PooledConnection

__all__ = ["Connection"]

_TRANSPORTS = "asyncinfer.broker.transport"

#: The project's transport (its import path) for each kombu transport name it replaces, and back.
_OURS: dict[str, str] = {"redis": f"{_TRANSPORTS}:Transport", "rediss": f"{_TRANSPORTS}:SecureTransport",
                         "sentinel": f"{_TRANSPORTS}:SentinelTransport"}


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


class _PooledConnection(PooledConnection, Connection):  # type: ignore[misc]
    """kombu's pooled connection, named by its URL's scheme as :class:`Connection` is."""


class _ConnectionPool(ConnectionPool):  # type: ignore[misc]
    """kombu's connection pool, of :class:`_PooledConnection`."""

    def new(self) -> Any:
        return _PooledConnection(self, **dict(self.connection._info(resolve=False)))
