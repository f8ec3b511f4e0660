"""Redis clients for every broker URL asyncinfer accepts: ``redis://``, ``rediss://``, ``unix://`` and
Celery's ``sentinel://``.

A Sentinel URL lists the Sentinels, ``;``-separated, in Celery's form
``sentinel://[:password@]host:port[/db];sentinel://host:port[/db]``; the password (if any) is the
Redis master's, the Sentinels' own is ``ASYNCINFER_SENTINEL_PASSWORD``, and the master is
``ASYNCINFER_SENTINEL_MASTER``. Its client asks the Sentinels for the master's address whenever it
opens a connection, so after a failover it follows the promoted replica; a ``READONLY`` reply (a
demoted master still connected to) closes the connection and is raised as a ``ConnectionError``,
which every asyncinfer loop retries, reconnecting to the new master.

Celery and kombu take the database and the password of a Sentinel URL from its *first* entry only;
:func:`normalized_url` (broker/urls.py, URLs as text) copies them into every entry, so that ``sentinel://a:26379;sentinel://b:26379/2``
means database 2 for Celery, kombu and asyncinfer alike.

Redis replicates asynchronously: :func:`require_replicas` waits until ``ASYNCINFER_SUBMIT_REPLICAS``
replicas hold every write made so far (Redis ``WAIT``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

import redis
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

from asyncinfer.broker.command_packer import connection_kwargs
from asyncinfer.broker.refusals import refusal_reason
from asyncinfer.broker.urls import (
    is_cluster_url,
    is_sentinel_url,
    parse_sentinel_url,
)
from asyncinfer.errors import AsyncInferError, BrokerRefused, BrokerUnavailable, NotReplicated
from asyncinfer.wire.keys import REPLICATION_MARK_CHANNEL

__all__ = ["redis_client", "sentinel_kwargs", "wait_replicas", "require_replicas", "not_replicated",
           "broker_error", "never_resend", "bounded_client", "MASTER_CHECK_S"]

#: How often (seconds, at most) a connection asks the Sentinels whether its master still is one.
MASTER_CHECK_S = 1.0

log = logging.getLogger(__name__)


class ConnectionSettings(Protocol):
    """What a connection reads of the settings (:class:`asyncinfer.config.settings.Settings`)."""

    @property
    def sentinel_master(self) -> str: ...

    @property
    def sentinel_password(self) -> str: ...

    @property
    def connect_timeout_s(self) -> float: ...


def sentinel_kwargs(settings: ConnectionSettings | None) -> dict[str, Any] | None:
    """Connection arguments for the Sentinels themselves (Celery's ``sentinel_kwargs``): their
    password, when ``ASYNCINFER_SENTINEL_PASSWORD`` is set; else None."""
    password = settings.sentinel_password if settings is not None else ""
    return {"password": password} if password else None


class _SentinelMaster(redis.Redis):
    """A client of the master a Sentinel group names; closing it closes the Sentinel connections."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            manager = getattr(self.connection_pool, "sentinel_manager", None)
            if manager is not None:
                manager.close()


class _FollowingConnection(SentinelManagedConnection):
    """A connection to the master a Sentinel group names, which leaves a master that is no longer
    the one.

    redis-py's own Sentinel-managed connection asks the Sentinels only when the pool hands it out
    unconnected: its retries reconnect to the address it had, and a live old master after a
    failover (promoted replica, old master not yet demoted: about 10 s with Sentinel's defaults,
    measured here) keeps taking writes that its demotion then discards. This one

    - asks the Sentinels whenever it opens a socket;
    - before a command, at most every :data:`MASTER_CHECK_S`, asks them again, and reconnects when
      they name another master (the writes of that gap are what ``ASYNCINFER_SUBMIT_REPLICAS``
      guards: the old master has no replica left to confirm them);
    - turns a ``READONLY`` reply, also one wrapped in a script error (Redis 6 reports a write
      refused inside EVAL as ``ERR Error running script ... READONLY ...``), into a
      ConnectionError after closing the socket, so the retry finds the new master (so does
      ``WAIT cannot be used with replica instances``).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._next_check_s = 0.0

    def _connect(self) -> Any:
        if self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
            self._next_check_s = time.monotonic() + MASTER_CHECK_S
        return super()._connect()

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self._sock is not None and self.connection_pool.is_master:
            self.leave_old_master()
        super().send_packed_command(command, check_health)

    def leave_old_master(self) -> None:
        """Disconnect when the Sentinels name another master (asked at most every
        :data:`MASTER_CHECK_S`)."""
        now = time.monotonic()
        if now >= self._next_check_s:
            self._next_check_s = now + MASTER_CHECK_S
            try:
                self.connection_pool.get_master_address()  # also drops the pool's idle ones
            except redis.ConnectionError:
                return  # no Sentinel answers: keep the master we have
        known = self.connection_pool.master_address
        if known is not None and tuple(known) != (self.host, self.port):
            log.warning("Sentinel names %s:%s as master now; leaving %s:%s", *known, self.host,
                        self.port)
            self.disconnect()

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            text = str(exc)
            if ("READONLY" in text or "replica instances" in text) and self.connection_pool.is_master:
                self.disconnect()
                raise redis.ConnectionError(f"the master is now a replica ({exc})") from exc
            raise


def never_resend(*, asyncio: bool = False) -> Any:
    """A redis-py ``retry`` for connections that must not send a command twice: none.

    redis-py retries a command (a whole pipeline) on a new connection when the old one fails,
    whether or not Redis ran it first; for a group of pushes (client/grouped.py) a reply lost on
    the way back would push every request again. Since redis-py's defaults have changed between
    versions, the producers' connections say so themselves. ``asyncio``: the ``redis.asyncio``
    form.
    """
    from redis.backoff import NoBackoff

    if asyncio:
        from redis.asyncio.retry import Retry as AsyncRetry

        return AsyncRetry(NoBackoff(), 0)
    from redis.retry import Retry

    return Retry(NoBackoff(), 0)


def redis_client(url: str, settings: ConnectionSettings | None = None, **kwargs: Any) -> redis.Redis:
    """A client of the Redis server ``url`` names; ``kwargs`` go to redis-py's connections.

    For ``sentinel://`` the client is the master's that the Sentinels name
    (``settings.sentinel_master``, default ``mymaster``), found again after every failover; for
    a Redis Cluster (``rediscluster://``) the fleet's shard's (cluster_client.py).
    """
    if is_cluster_url(url):
        from asyncinfer.broker.cluster_client import shard_client

        return shard_client(url, **kwargs)
    kwargs = connection_kwargs(kwargs)
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **kwargs)
    # A client option, not a connection option: applied to the master's client below.
    single_connection = bool(kwargs.pop("single_connection_client", False))
    parsed = parse_sentinel_url(url)
    master = settings.sentinel_master if settings is not None else "mymaster"
    own: dict[str, Any] = sentinel_kwargs(settings) or {}
    # Sentinel queries are short: never wait on a silent Sentinel longer than a connect.
    timeout_s = kwargs.get("socket_connect_timeout") or kwargs.get("socket_timeout") or (
        settings.connect_timeout_s if settings is not None else 5.0)
    own.setdefault("socket_timeout", timeout_s)
    own.setdefault("socket_connect_timeout", timeout_s)
    manager = Sentinel(list(parsed.sentinels), sentinel_kwargs=own)
    credentials: Mapping[str, Any] = {k: v for k, v in (("username", parsed.username),
                                                          ("password", parsed.password)) if v}
    client: redis.Redis = manager.master_for(
        master, redis_class=_SentinelMaster, connection_pool_class=SentinelConnectionPool,
        connection_class=_FollowingConnection, db=parsed.db, **credentials, **kwargs)
    if single_connection:
        client = _SentinelMaster(connection_pool=client.connection_pool, single_connection_client=True)
    return client


def bounded_client(url: str, settings: ConnectionSettings) -> redis.Redis:
    """A client of ``url`` that waits at most ``connect_timeout_s`` (at least 1 s) for a connect
    or a reply: for short reads and writes (the catalogue) that must not hang on a Redis that
    accepts connections and answers nothing (frozen, or its host gone mid-stream)."""
    timeout_s = max(settings.connect_timeout_s, 1.0)
    return redis_client(url, settings, socket_connect_timeout=settings.connect_timeout_s,
                        socket_timeout=timeout_s)


def wait_replicas(client: redis.Redis, replicas: int, timeout_ms: int) -> int:
    """How many replicas hold every write made on ``client``'s master so far, waiting up to
    ``timeout_ms`` for ``replicas`` of them (Redis ``WAIT``).

    Redis' WAIT counts the writes of its own connection only, and a pooled client may send it on
    another connection than the one that wrote (and WAIT inside MULTI never waits): so WAIT follows
    a PUBLISH on :data:`REPLICATION_MARK_CHANNEL` in one pipeline. The PUBLISH is replicated, so
    waiting for it waits for every write the master took before it — ours, in any connection.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas!r}")
    if timeout_ms < 1:
        raise ValueError(f"timeout_ms must be >= 1 (0 would wait forever), got {timeout_ms!r}")
    pipe = client.pipeline(transaction=False)
    pipe.publish(REPLICATION_MARK_CHANNEL, b"")
    pipe.execute_command("WAIT", int(replicas), int(timeout_ms))
    return int(pipe.execute()[-1])


def require_replicas(client: redis.Redis, replicas: int, timeout_ms: int, what: str) -> int:
    """:func:`wait_replicas`, raising :class:`~asyncinfer.errors.NotReplicated` (naming ``what``,
    e.g. ``"request <id>"``) when fewer than ``replicas`` confirmed in ``timeout_ms``. The writes are
    on the master either way. Returns the count."""
    confirmed = wait_replicas(client, replicas, timeout_ms)
    error = not_replicated(what, confirmed, replicas, timeout_ms)
    if error is not None:
        raise error
    return confirmed


def not_replicated(what: str, confirmed: int, replicas: int, timeout_ms: int) -> NotReplicated | None:
    """The :class:`~asyncinfer.errors.NotReplicated` of ``what`` when ``confirmed`` (of a
    :func:`wait_replicas` that waited ``timeout_ms``) is fewer than ``replicas``; else None."""
    if confirmed >= replicas:
        return None
    return NotReplicated(
        f"{what}: written on the Redis master, but {confirmed} of {replicas} replicas confirmed it "
        f"within {timeout_ms} ms (ASYNCINFER_SUBMIT_REPLICAS); a failover now could lose it",
        confirmed=confirmed, required=replicas)


def broker_error(request_id: str, exc: redis.RedisError) -> AsyncInferError:
    """The asyncinfer error for a Redis error that a publish of ``request_id`` met.

    Unreachable, timed out or refused credentials: :class:`BrokerUnavailable`; Redis refusing the
    write (a full disk, out of memory, a read-only replica, a missing permission, any other error
    reply): :class:`BrokerRefused`, naming the cause and quoting Redis
    (:func:`~asyncinfer.broker.refusals.refusal_reason`). A timeout leaves it open whether the
    request went out.
    """
    where = f"request {request_id}: "
    if isinstance(exc, redis.AuthenticationError):
        return BrokerUnavailable(where + f"broker refused the credentials in the broker URL: {exc}")
    if isinstance(exc, redis.TimeoutError):
        return BrokerUnavailable(where + f"broker did not answer in time ({exc}); the request may "
                                 "have been sent all the same: submit it again with the same "
                                 "request_id to have it run once")
    if isinstance(exc, redis.ConnectionError):
        return BrokerUnavailable(where + f"broker unreachable: {exc}")
    # A refusal inside a script comes as a plain ResponseError carrying Redis' error code.
    said = str(exc) or f"{type(exc).__name__}, with no message"
    if isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in said:
        return BrokerRefused(where + f"broker user lacks a permission (Redis ACL): {said}")
    reason = refusal_reason(exc)
    if reason is not None:  # "the broker cannot write to its disk (MISCONF ...)", ...
        return BrokerRefused(where + reason.removeprefix("the ") + "; not sent")
    return BrokerRefused(where + f"broker refused the request ({type(exc).__name__}): {said}")
