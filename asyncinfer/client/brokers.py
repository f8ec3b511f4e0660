"""What a client holds per broker: its Celery app, its catalogue, its sender; and, with a routing
table (``ASYNCINFER_BROKER_ROUTES``, config/routes.py), one such group per broker URL of the table.

A :class:`~asyncinfer.client.client.Client` of one broker holds one :class:`BrokerGroup`. With a
table it holds :class:`RoutedGroups`: the default broker's group, and each other broker's made
when a model routed there is first asked for. A request goes to its model's group, whole: its
queue, its result, its catalogue check are on that broker.
"""

from __future__ import annotations

import threading
from typing import Any

import redis
from celery import Celery

from asyncinfer.broker.catalogue import Catalogue, CatalogueEntry
from asyncinfer.broker.connections import bounded_client, broker_error
from asyncinfer.broker.fleet_stats import FleetStats
from asyncinfer.broker.urls import is_redis_url, masked_url, shard_urls
from asyncinfer.celery_app import create_app
from asyncinfer.client.known_models import KnownModels
from asyncinfer.client.pinger import Pinger
from asyncinfer.client.sender import Sender
from asyncinfer.config.routes import Routes
from asyncinfer.config.settings import Settings
from asyncinfer.constants import model_from_queue
from asyncinfer.errors import AsyncInferError

__all__ = ["BrokerGroup", "RoutedGroups"]


class BrokerGroup:
    """One broker's part of a client: the app of ``settings`` (one broker, no routes), the
    catalogue on its result backend, the unknown-model check and the sender."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app: Celery = create_app(settings)
        backend_url = str(self.app.conf.result_backend)
        # A connection of its own, bounded by connect_timeout_s: Celery's backend client waits
        # 120 s on a Redis that accepts connections and answers nothing (frozen, or its host gone
        # mid-stream), and the unknown-model check reads the catalogue on a submit.
        self.catalogue = (Catalogue(bounded_client(backend_url, settings),
                                    ttl_s=settings.catalogue_ttl_s,
                                    retention_s=settings.model_retention_s)
                          if is_redis_url(backend_url) else None)
        self.known = (KnownModels(self.catalogue, settings.model_retention_s)
                      if self.catalogue is not None else None)
        #: What every submit, blocking or asyncio, stands on (client/sender.py); on a cluster URL
        #: that spreads requests, with a sender (and a Celery app) per shard.
        self._lane_apps = [create_app(settings.for_broker(url))
                           for url in shard_urls(str(self.app.conf.broker_url))[1:]]
        self.sender = Sender(settings, self.app, self.known,
                             lanes=[Sender(settings, app, self.known) for app in self._lane_apps])
        self.pinger = Pinger(settings)

    def models(self) -> dict[str, CatalogueEntry]:
        """The catalogue of this broker's fleet ({} on a result backend that is not Redis)."""
        if self.catalogue is None:
            return {}
        try:
            return self.catalogue.read()
        except redis.RedisError as exc:
            raise self.sender.broker_error(broker_error("models", exc)) from exc

    def statistics(self, model: str | None = None) -> list[dict[str, Any]]:
        """This broker's fleet statistics in Triton's form (broker/fleet_stats.py): of ``model``, or of
        every model with counts ([] on a result backend that is not Redis)."""
        if self.catalogue is None:
            return []
        fleet = FleetStats(self.catalogue.client, retention_s=self.settings.model_retention_s)
        try:
            return fleet.model_stats(model=model)
        except redis.RedisError as exc:
            raise self.sender.broker_error(broker_error("statistics", exc)) from exc

    def ping(self) -> None:
        """Raise BrokerUnavailable (one line) unless the broker and the result backend answer."""
        try:
            self.pinger.ping_app(self.app, redis_broker=self.sender.broker is not None)
        except AsyncInferError as exc:
            raise self.sender.broker_error(exc) from exc.__cause__

    def close(self) -> None:
        self.sender.close()
        self.pinger.close()
        self.app.close()
        for app in self._lane_apps:
            app.close()


class RoutedGroups:
    """One :class:`BrokerGroup` per broker URL of ``routes``; ``default`` is the default URL's,
    the others are made on first use (for the ``settings`` of that one broker)."""

    def __init__(self, routes: Routes, settings: Settings, default: BrokerGroup) -> None:
        self.routes = routes
        self.settings = settings
        self._groups = {routes.default_url: default}
        self._lock = threading.Lock()
        #: broker URL → its catalogue as last read (what ``models(stale_ok=True)`` falls back on)
        self._last_read: dict[str, dict[str, CatalogueEntry]] = {}

    def for_model(self, model: str) -> BrokerGroup:
        """The group of ``model``'s broker."""
        url = self.routes.url_for(model)
        group = self._groups.get(url)
        return group if group is not None else self.for_url(url)

    def for_queue(self, queue: str) -> BrokerGroup:
        """The group of the model that ``queue`` (``infer.<model>``) carries; the default's for
        any other queue."""
        model = model_from_queue(queue)
        return self.for_model(model) if model else self._groups[self.routes.default_url]

    def for_url(self, url: str) -> BrokerGroup:
        group = self._groups.get(url)
        if group is None:
            with self._lock:
                group = self._groups.get(url)
                if group is None:
                    group = self._groups[url] = BrokerGroup(self.settings.for_broker(url))
        return group

    def every(self) -> list[BrokerGroup]:
        """The group of every broker of the table (made now where not yet), the default's first."""
        return [self.for_url(url) for url in self.routes.urls()]

    def made(self) -> list[BrokerGroup]:
        """The groups made so far."""
        with self._lock:
            return list(self._groups.values())

    def models(self, *, stale_ok: bool = False) -> dict[str, CatalogueEntry]:
        """Every broker's catalogue in one: a model's entry from the broker it is routed to, else
        from the first that has it (a worker started by hand on another).

        ``stale_ok``: a broker that does not answer gives its catalogue as last read (its models
        stay known: their calls fail as that broker's, not as unknown models); the error is
        raised only when no broker answers."""
        merged: dict[str, CatalogueEntry] = {}
        failed: list[AsyncInferError] = []
        urls = self.routes.urls()
        for url in urls:
            try:
                read = self._last_read[url] = self.for_url(url).models()
            except AsyncInferError as exc:
                if not stale_ok:
                    raise type(exc)(f"{masked_url(url)}: {exc}") from exc
                failed.append(exc)
                read = self._last_read.get(url, {})
            for name, entry in read.items():
                if name not in merged or self.routes.url_for(name) == url:
                    merged[name] = entry
        if len(failed) == len(urls):
            raise failed[0]
        return merged

    def ping(self) -> None:
        """Raise BrokerUnavailable naming the broker unless every broker of the table answers."""
        for url in self.routes.urls():
            try:
                self.for_url(url).ping()
            except AsyncInferError as exc:
                raise type(exc)(f"{masked_url(url)}: {exc}") from exc.__cause__
