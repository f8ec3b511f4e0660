"""What ``asyncinfer status`` shows: workers (device, models, requests in flight and pending,
recent requests per second) and the depth of every model queue."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from celery import Celery

from asyncinfer.constants import PRIORITY_SEP, QUEUE_PREFIX, model_from_queue, priority_lists
from asyncinfer.wire.model_versions import split_key

__all__ = ["WorkerInfo", "ClusterStatus", "cluster_status", "format_status"]



@dataclass
class WorkerInfo:
    """One worker as it answered the ``asyncinfer_info`` control command."""

    name: str
    device: str
    models: list[str]
    pid: int = 0
    pending: dict[str, int] = field(default_factory=dict)
    #: Requests taken from the queues and not yet answered.
    in_flight: int = 0
    #: Requests the worker finished per second over the last ~10 s.
    throughput_per_s: float = 0.0


@dataclass
class ClusterStatus:
    """Workers that answered, and queue depths read from the broker."""

    workers: list[WorkerInfo]
    queue_depths: dict[str, int]


def queue_depths(app: Celery, models: set[str]) -> dict[str, int]:
    """Messages waiting in each ``infer.<model>`` queue (Redis; on AMQP the hosted models')."""
    depths: dict[str, int] = {}
    with app.connection_for_read() as conn:
        if conn.transport.driver_type != "redis":
            return {m: _declared_depth(conn, QUEUE_PREFIX + m) for m in sorted(models)}
        clients = shard_clients(str(app.conf.broker_url)) or [conn.default_channel.client]
        try:
            names = {m for client in clients
                     for k in client.scan_iter(match=QUEUE_PREFIX + "*", count=1000)
                     if (m := model_from_queue(k.decode() if isinstance(k, bytes) else k))
                     and PRIORITY_SEP not in m}
            for model in sorted(models | names):
                lists = priority_lists([QUEUE_PREFIX + model])
                depths[model] = sum(int(c.llen(key)) for c in clients for key in lists)
        finally:
            if len(clients) > 1:
                for client in clients:
                    client.close()
    return depths


def shard_clients(url: str) -> list[Any]:
    """A client of each shard of a cluster URL that spreads requests ([] for any other URL: its
    one Redis is the caller's)."""
    from asyncinfer.broker.connections import redis_client
    from asyncinfer.broker.urls import shard_urls

    urls = shard_urls(url)
    return [redis_client(u) for u in urls] if len(urls) > 1 else []


def _declared_depth(conn: Any, queue: str) -> int:
    """Ready messages of ``queue`` on an AMQP broker (a passive declare; 0 if it does not exist)."""
    channel = conn.channel()
    try:
        return int(channel.queue_declare(queue, passive=True).message_count)
    except conn.channel_errors:  # NOT_FOUND: no one declared it yet; the server closed the channel
        return 0
    finally:
        try:
            channel.close()
        except Exception:  # noqa: BLE001 - already closed by the server
            pass


def cluster_status(app: Celery, timeout_s: float = 1.0) -> ClusterStatus:
    """Ask every worker for its device and models; read the queue depths."""
    replies: list[dict[str, Any]] = app.control.broadcast(
        "asyncinfer_info", reply=True, timeout=timeout_s) or []
    workers = []
    for reply in replies:
        for name, info in reply.items():
            workers.append(WorkerInfo(name=name, device=info.get("device", "?"),
                                      models=list(info.get("models", [])),
                                      pid=int(info.get("pid", 0)),
                                      pending=dict(info.get("pending", {})),
                                      in_flight=int(info.get("in_flight", 0)),
                                      throughput_per_s=float(info.get("throughput_per_s", 0.0))))
    workers.sort(key=lambda w: w.name)
    # every version of a model (``m@2``) takes the model's one queue, infer.m
    hosted = {split_key(m)[0] for w in workers for m in w.models}
    return ClusterStatus(workers=workers, queue_depths=queue_depths(app, hosted))


def format_status(status: ClusterStatus) -> str:
    """A plain-text table of the status."""
    wide = max([30] + [len(",".join(w.models)) for w in status.workers])  # models column
    lines = [f"{'WORKER':32} {'DEVICE':10} {'MODELS':{wide}} {'IN-FLIGHT':>9} {'PENDING':>7} "
             f"{'REQ/S':>8}"]
    for w in status.workers:
        pending = sum(w.pending.values())
        lines.append(f"{w.name:32} {w.device:10} {','.join(w.models):{wide}} {w.in_flight:>9} "
                     f"{pending:>7} {w.throughput_per_s:>8.1f}")
    if not status.workers:
        lines.append("(no worker answered)")
    lines += ["", f"{'QUEUE':32} DEPTH"]
    for model, depth in status.queue_depths.items():
        lines.append(f"{QUEUE_PREFIX + model:32} {depth}")
    return "\n".join(lines)
