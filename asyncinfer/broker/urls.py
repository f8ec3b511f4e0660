"""Broker and result backend URLs: which name a Redis server, and what a Sentinel URL lists.

Plain text, no connection: the settings judge a URL with it (config/settings.py) and the Redis
clients are made from it (connections.py). A Sentinel URL lists the Sentinels, ``;``-separated, in
Celery's form ``sentinel://[:password@]host:port[/db];sentinel://host:port[/db]``; Celery and kombu
take the database and the password of a Sentinel URL from its *first* entry only:
:func:`normalized_url` copies them into every entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote, urlsplit

__all__ = ["REDIS_SCHEMES", "CLUSTER_SCHEMES", "SentinelUrl", "ClusterUrl", "is_redis_url",
           "is_sentinel_url", "is_cluster_url", "has_asyncio_client", "parse_sentinel_url",
           "parse_cluster_url", "pinned_url", "shard_urls", "masked_url", "normalized_url",
           "DEFAULT_SENTINEL_PORT", "URL_EXAMPLES"]

#: A Redis Cluster: ``rediscluster://`` (the name go-redis and kombu's proposed transport give it),
#: ``redisclusters://`` over TLS (as ``rediss://`` is to ``redis://``). Not ``redis+cluster://``:
#: kombu reads ``a+b://`` as transport ``a`` for the URL ``b://``.
CLUSTER_SCHEMES = ("rediscluster", "redisclusters")
#: URL schemes served by Redis (a Sentinel URL names the Sentinels of one, a cluster URL some nodes
#: of a Redis Cluster).
REDIS_SCHEMES = ("redis", "rediss", "unix", "sentinel", *CLUSTER_SCHEMES)
DEFAULT_SENTINEL_PORT = 26379
_SEPARATOR = ";"

#: What a broker or result backend URL looks like (said when a value is not one).
URL_EXAMPLES = ("redis://[:password@]host:6379/0, rediss://…, unix:///path/redis.sock, "
                "sentinel://host:26379;sentinel://host2:26379/0, "
                "rediscluster://host:7000/?nodes=host2:7000 or amqp://user:password@host:5672//")


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names Redis: ``redis://``, ``rediss://``, ``unix://``, ``sentinel://`` or a
    cluster's (:data:`CLUSTER_SCHEMES`)."""
    return _scheme(url) in REDIS_SCHEMES


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` is Celery's ``sentinel://host:port;sentinel://host:port/db`` form."""
    return _scheme(url) == "sentinel"


def has_asyncio_client(url: str) -> bool:
    """Whether asyncinfer reads and writes ``url``'s Redis from an event loop with ``redis.asyncio``
    (one Redis); a Sentinel group's and a cluster's clients are blocking ones, run in threads."""
    return is_redis_url(url) and not is_sentinel_url(url) and not is_cluster_url(url)


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (:data:`CLUSTER_SCHEMES`)."""
    return _scheme(url) in CLUSTER_SCHEMES


@dataclass(frozen=True)
class ClusterUrl:
    """What a cluster URL names: some of the cluster's nodes (the client learns the rest from
    them), the credentials, TLS, and which ``shard`` of ``shards`` its keys are (broker/shards.py)."""

    seeds: tuple[tuple[str, int], ...]
    shards: int
    tls: bool = False
    username: str | None = None
    password: str | None = None
    shard: int = 0
    #: Whether the URL spreads each model's requests over all its shards (``shards=N`` and no
    #: ``shard``): a request lives on the shard its ID falls in (shards.py's
    #: :func:`~asyncinfer.broker.shards.request_shard`); what is not a request's (the catalogue,
    #: statistics, model control, Celery's own) on shard 0.
    spread: bool = False


def pinned_url(url: str, shard: int) -> str:
    """Cluster URL ``url`` naming shard ``shard`` alone (``&shard=K``; a spread URL's shard)."""
    base, _, fragment = url.partition("#")
    kept = [(n, v) for n, v in parse_qsl(urlsplit(base).query, keep_blank_values=True)
            if n != "shard"]
    head = base.split("?", 1)[0]
    query = "&".join(f"{n}={v}" for n, v in [*kept, ("shard", str(shard))])
    return f"{head}?{query}" + (f"#{fragment}" if fragment else "")


def shard_urls(url: str) -> list[str]:
    """The URL of each shard a broker URL serves requests on: every shard of a spread cluster URL
    (shard 0 first), else ``url`` itself."""
    if not is_cluster_url(url):
        return [url]
    parsed = parse_cluster_url(url)
    return [pinned_url(url, k) for k in range(parsed.shards)] if parsed.spread else [url]


def parse_cluster_url(url: str) -> ClusterUrl:
    """Parse ``rediscluster://[[user]:password@]host:port[/][?nodes=host:port,…][&shards=N][&shard=K]``
    (``redisclusters://`` over TLS): one node in the URL's place for a host, as kombu and Celery
    read a URL, and any others in ``nodes``; the URL's keys are shard ``K`` (0 to N - 1) of ``N``
    (default 1), or — ``shards=N`` without ``shard`` — all N, each request on the shard its ID
    falls in (``spread``; shard 0 for what is not a request's). Raises ValueError naming the rule
    a URL breaks."""
    from asyncinfer.broker.shards import DEFAULT_SHARDS, SLOTS

    parts = urlsplit(url)
    shown = re.sub(r"(//[^:@/]*:)[^@/]*@", r"\1**@", url)  # its password hidden
    if parts.scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(f"a Redis Cluster URL starts with rediscluster://, got {shown!r}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"Redis Cluster URL {shown!r}: host:port expected (more nodes go in "
                         "?nodes=host:port,host:port)") from None
    if not parts.hostname or port is None:
        raise ValueError(f"Redis Cluster URL {shown!r}: host:port expected")
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has one database (0); the URL names {parts.path!r}")
    seeds = [(parts.hostname, port)]
    shards, shard, named = DEFAULT_SHARDS, 0, False
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name == "nodes":
            for entry in filter(None, (v.strip() for v in value.split(","))):
                host, _, node_port = entry.rpartition(":")
                if not host or not node_port.isdigit():
                    raise ValueError(f"Redis Cluster URL node {entry!r}: host:port expected")
                seeds.append((host.strip("[]"), int(node_port)))
        elif name == "shards":
            if not value.isdigit() or not 1 <= int(value) <= SLOTS:
                raise ValueError(f"a Redis Cluster URL's shards must be 1 to {SLOTS}, got {value!r}")
            shards = int(value)
        elif name == "shard":
            if not value.isdigit():
                raise ValueError(f"a Redis Cluster URL's shard must be a number, got {value!r}")
            shard, named = int(value), True
        else:
            raise ValueError(f"a Redis Cluster URL takes the options 'nodes', 'shards' and 'shard', "
                             f"not {name!r}")
    if shard >= shards:
        raise ValueError(f"a Redis Cluster URL's shard is 0 to shards - 1 ({shards - 1}), got {shard}")
    return ClusterUrl(tuple(seeds), shards, tls=parts.scheme.lower() == "redisclusters",
                      username=unquote(parts.username) if parts.username else None,
                      password=unquote(parts.password) if parts.password else None, shard=shard,
                      spread=shards > 1 and not named)


@dataclass(frozen=True)
class SentinelUrl:
    """What a ``sentinel://`` URL names: the Sentinels, and the database and credentials of the
    master they watch."""

    sentinels: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None

    def url(self) -> str:
        """The URL again, with the database and credentials in every entry (:func:`normalized_url`)."""
        user = quote(self.username, safe="") if self.username else ""
        auth = (f"{user}:{quote(self.password, safe='')}@" if self.password
                else (f"{user}@" if user else ""))
        return _SEPARATOR.join(f"sentinel://{auth}{host}:{port}/{self.db}" for host, port in self.sentinels)


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Parse ``sentinel://[[user]:password@]host[:port][/db];...``.

    The database and credentials may stand in any entry; entries that name them must agree.
    Raises ValueError naming the entry and the rule it breaks.
    """
    sentinels: list[tuple[str, int]] = []
    dbs: set[int] = set()
    users: set[str] = set()
    passwords: set[str] = set()
    for entry in (part.strip() for part in url.split(_SEPARATOR)):
        if not entry:
            continue
        parts = urlsplit(entry)
        if parts.scheme.lower() != "sentinel":
            raise ValueError(f"every entry of a Sentinel URL must start with sentinel://, got {entry!r}")
        try:
            port = parts.port or DEFAULT_SENTINEL_PORT
        except ValueError:
            raise ValueError(f"Sentinel URL entry {entry!r}: the port must be a number") from None
        if not parts.hostname:
            raise ValueError(f"Sentinel URL entry {entry!r} names no host")
        sentinels.append((parts.hostname, port))
        path = parts.path.strip("/")
        if path:
            if not path.isdigit():
                raise ValueError(f"Sentinel URL entry {entry!r}: the database must be a number, got {path!r}")
            dbs.add(int(path))
        if parts.username:
            users.add(unquote(parts.username))
        if parts.password:
            passwords.add(unquote(parts.password))
    if not sentinels:
        raise ValueError(f"a Sentinel URL must name at least one Sentinel, got {url!r}")
    for what, values in (("databases", dbs), ("usernames", users), ("passwords", passwords)):
        if len(values) > 1:
            shown = sorted(map(str, values)) if what == "databases" else f"{len(values)} different"
            raise ValueError(f"the entries of a Sentinel URL name different {what} ({shown}); name one")
    return SentinelUrl(tuple(sentinels), db=next(iter(dbs), 0), username=next(iter(users), None),
                       password=next(iter(passwords), None))


def masked_url(url: str) -> str:
    """``url`` with every password in it replaced by ``**`` (each entry of a Sentinel URL too)."""
    from kombu.utils.url import maybe_sanitize_url

    return ";".join(str(maybe_sanitize_url(part)) for part in url.split(";"))


def normalized_url(url: str) -> str:
    """``url`` as Celery and kombu read it the same way asyncinfer does: a Sentinel URL gets its
    database and credentials in every entry (they read only the first); other URLs are unchanged."""
    return parse_sentinel_url(url).url() if is_sentinel_url(url) else url
