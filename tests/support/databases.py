"""Databases of the one session Redis, handed out so that no two holders share one.

A test (or a module's fixture) that needs a broker no other worker consumes takes a database from
:class:`RedisDatabases` (fixtures ``redis_db`` and ``redis_databases`` in conftest.py): it is
emptied when handed out and again when given back, and the session worker's database is never
handed out. Given-back numbers go to the back of the line, so a number is reused as late as can be.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import redis

__all__ = ["url_with_db", "db_of", "RedisDatabase", "RedisDatabases", "gated_broker",
           "gated_executions"]


def url_with_db(url: str, db: int) -> str:
    """``url`` pointing at database ``db`` of the same server."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


def db_of(url: str) -> int:
    """The database number in ``url`` (0 when it names none)."""
    path = urlsplit(url).path.strip("/")
    return int(path) if path else 0


@dataclass(frozen=True)
class RedisDatabase:
    """One handed-out database: its number, its URL and a client of it."""

    number: int
    url: str
    client: redis.Redis


class RedisDatabases:
    """Hands out the databases of the Redis at ``redis_url`` other than the one it names.

    Args:
        redis_url: the session Redis (its own database stays the session worker's).
        count: how many databases the server has; asked (``CONFIG GET databases``) when None.
        connect: makes a client from a URL (``redis.Redis.from_url``).
    """

    def __init__(self, redis_url: str, count: int | None = None,
                 connect: Callable[[str], redis.Redis] = redis.Redis.from_url) -> None:
        self.redis_url = redis_url
        self._connect = connect
        if count is None:
            probe = connect(redis_url)
            try:
                count = int(probe.config_get("databases")["databases"])
            finally:
                probe.close()
        own = db_of(redis_url)
        self._free = deque(n for n in range(count) if n != own)
        self._held: dict[int, str] = {}

    @property
    def held(self) -> dict[int, str]:
        """Database number → who holds it."""
        return dict(self._held)

    @contextmanager
    def take(self, holder: str = "") -> Iterator[RedisDatabase]:
        """An emptied database for the ``with`` block (named ``holder`` in errors), emptied after.

        Raises:
            RuntimeError: every database is held, naming the holders.
        """
        if not self._free:
            raise RuntimeError(f"every database of {self.redis_url} is held: {self._held}")
        number = self._free.popleft()
        self._held[number] = holder or f"pid {os.getpid()}"
        client = self._connect(url_with_db(self.redis_url, number))
        try:
            client.flushdb()
            yield RedisDatabase(number, url_with_db(self.redis_url, number), client)
        finally:
            try:
                client.flushdb()
            finally:
                client.close()
                del self._held[number]
                self._free.append(number)


def gated_broker(url: str, tag: str,
                 visibility_timeout_s: str = "4") -> tuple[str, redis.Redis, dict[str, str]]:
    """For workers of the "gated" test model on the (handed-out) database ``url``: a key prefix
    for the model's records, a client of the database, and the workers' environment."""
    prefix = f"{tag}-{os.urandom(4).hex()}"
    env = {"ASYNCINFER_VISIBILITY_TIMEOUT_S": visibility_timeout_s, "GATED_REDIS_URL": url,
           "GATED_PREFIX": prefix}
    return prefix, redis.Redis.from_url(url), env


def gated_executions(r: redis.Redis, prefix: str) -> dict[int, int]:
    """How often the "gated" model ran each index."""
    return {int(k): int(v) for k, v in r.hgetall(f"{prefix}:executions").items()}
