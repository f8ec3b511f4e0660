"""The worker's start-up banner, telling the truth about a device worker.

Celery's banner shows its own consumer: a pool of two threads and the one queue
(``asyncinfer.control``) it reads beside the fast consumer, and kombu shows every Redis URL with a
masked password (``redis://:**@host``) whether it has one or not. Here the banner also names the
``infer.*`` queues the fast consumer serves and its in-flight bound, and shows the URLs as
``asyncinfer config`` does (a password masked only where there is one).
"""

from __future__ import annotations

from typing import Any

from celery.apps.worker import Worker as CeleryWorker

from asyncinfer.broker.urls import masked_url
from asyncinfer.config.bound import settings_of

__all__ = ["Worker", "truthful"]


def truthful(banner: str, *, broker: str, results: str, queues: list[str], in_flight: int) -> str:
    """``banner`` (Celery's) with the URLs, the concurrency and the queues of a device worker."""
    lines = []
    for line in banner.splitlines():
        if ".> transport:" in line:
            line = line[:line.index(".> transport:")] + f".> transport:   {broker}"
        elif ".> results:" in line:
            line = line[:line.index(".> results:")] + f".> results:     {results}"
        elif ".> concurrency:" in line and queues:
            line += f"; fast consumer: {in_flight} requests in flight"
        lines.append(line)
        if "[queues]" in line and queues:
            lines += [f"{' ' * 16}.> {q} (fast consumer)" for q in queues]
    return "\n".join(lines) + "\n"


class Worker(CeleryWorker):  # type: ignore[misc]
    """Celery's worker with :func:`truthful`'s banner."""

    def startup_info(self, artlines: bool = True) -> Any:
        banner = super().startup_info(artlines)
        settings = settings_of(self.app)
        in_flight = settings.concurrency * settings.prefetch_multiplier if settings else 0
        return truthful(banner, broker=masked_url(str(self.app.conf.broker_url)),
                        results=masked_url(str(self.app.conf.result_backend)),
                        queues=_fast_queues(self), in_flight=in_flight)


def _fast_queues(controller: Any) -> list[str]:
    worker = getattr(controller, "asyncinfer", None)
    return list(worker.fast_queues) if worker is not None else []
