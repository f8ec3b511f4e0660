"""A client's quick check that its Redis servers answer: one PING each, no retry loop.

One no-retry connection per URL is kept, so a check on an open connection is one round trip.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncinfer.broker.connections import broker_error, redis_client
from asyncinfer.config.settings import Settings
from asyncinfer.errors import BrokerUnavailable

__all__ = ["Pinger"]


class Pinger:
    """PINGs Redis URLs within ``settings.connect_timeout_s``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._clients: dict[str, redis.Redis] = {}

    def ping(self, url: str) -> None:
        """Raise a one-line error unless ``url`` answers: BrokerUnavailable, or BrokerRefused for
        a server that answers with a refusal."""
        timeout_s = self.settings.connect_timeout_s
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = redis_client(
                url, self.settings, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0))
        try:
            client.ping()
        except redis.TimeoutError as exc:
            raise BrokerUnavailable(f"broker did not answer within {timeout_s:g} s ({exc})") from exc
        except redis.RedisError as exc:
            error = broker_error("ping", exc)  # the wording of a submit's, without a request
            raise type(error)(str(error).removeprefix("request ping: ")) from exc

    def ping_app(self, app: Any, *, redis_broker: bool) -> None:
        """PING the result backend of Celery ``app`` and its broker: a Redis broker (when
        ``redis_broker``) by PING, any other by one kombu connection attempt."""
        urls = [str(app.conf.result_backend)]
        if not redis_broker:  # another broker: one connection attempt, no retry loop
            try:
                with app.connection_for_read() as conn:
                    conn.ensure_connection(max_retries=1, timeout=self.settings.connect_timeout_s)
            except Exception as exc:  # noqa: BLE001 - kombu raises each transport's own errors
                raise BrokerUnavailable(f"broker unreachable: {exc}") from exc
        elif str(app.conf.broker_url) not in urls:
            urls.append(str(app.conf.broker_url))
        for url in urls:
            self.ping(url)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
