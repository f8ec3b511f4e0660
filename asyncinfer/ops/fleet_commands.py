"""The ``asyncinfer`` commands that read or act on the fleet through its brokers: status, cancel,
purge, config, gateway, models and stats (the parser is in cli.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

__all__ = ["cmd_status", "cmd_cancel", "cmd_purge", "cmd_config", "cmd_gateway", "cmd_models",
           "cmd_model_control", "cmd_stats"]


def _models(value: str) -> list[str]:
    return [m.strip() for m in value.split(",") if m.strip()]


def _client(args: argparse.Namespace) -> Any:
    from asyncinfer.client import Client

    return Client(broker_url=args.broker_url, serializer=getattr(args, "serializer", None))


def cmd_status(args: argparse.Namespace) -> int:
    from asyncinfer.broker.urls import masked_url
    from asyncinfer.ops.status import cluster_status, format_status

    with _client(args) as client:
        client.ping()  # one line at once when the broker is down, not kombu's retry loop
        apps = client.apps()  # with routes (ASYNCINFER_BROKER_ROUTES): one section per broker
        while True:
            statuses = {masked_url(url): cluster_status(app, timeout_s=args.timeout_s)
                        for url, app in apps.items()}
            if args.json:
                shown: Any = {url: dataclasses.asdict(s) for url, s in statuses.items()}
                print(json.dumps(shown if len(apps) > 1 else next(iter(shown.values())),
                                 sort_keys=True), flush=True)
            else:
                if args.watch:
                    print("\033[H\033[J", end="")  # clear the terminal between refreshes
                print("\n\n".join(format_status(s) if len(apps) == 1 else
                                  f"BROKER {url}\n{format_status(s)}"
                                  for url, s in statuses.items()), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)


def cmd_cancel(args: argparse.Namespace) -> int:
    """Revoke requests (Celery's revoke): a request not yet on the device never runs."""
    with _client(args) as client:
        client.ping()
        for app in client.apps().values():  # the request's model is not known: every broker
            app.control.revoke(list(args.request_ids))
        for request_id in args.request_ids:
            print(f"revoked {request_id}")
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    """Remove every request waiting on ``infer.MODEL`` (and its priority lists); each gets REVOKED,
    so whoever waits for it hears."""
    from asyncinfer.broker.connections import redis_client
    from asyncinfer.broker.urls import is_redis_url, shard_urls
    from asyncinfer.ops.purge import purge_queue, waiting

    with _client(args) as client:
        client.ping()
        app = client.app_for(args.model)
        url = str(app.conf.broker_url)
        if not is_redis_url(url):
            raise ValueError("purge reads Redis lists; on RabbitMQ use `celery -A asyncinfer purge -Q "
                             f"infer.{args.model}`")
        brokers = [redis_client(u, client.settings) for u in shard_urls(url)]  # a spread URL's all
        count = sum(waiting(broker, args.model) for broker in brokers)
        if not count:
            print(f"infer.{args.model}: nothing waiting")
            return 0
        if not args.yes:
            answer = input(f"remove {count} requests waiting on infer.{args.model}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("nothing removed")
                return 1
        removed = sum(purge_queue(broker, app.backend, args.model) for broker in brokers)
        print(f"infer.{args.model}: removed {removed} requests (REVOKED)")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from asyncinfer.config.settings import Settings
    from asyncinfer.config.settings_report import setting_sources, settings_table

    if args.table:
        print(settings_table())
        return 0
    from asyncinfer.broker.urls import masked_url

    settings = Settings.from_env(broker_url=args.broker_url)
    sources = setting_sources(broker_url=args.broker_url)
    origin = settings.broker_url_origin()
    if origin != "configured":
        sources["broker_url"] = (
            f"published by the running 'asyncinfer up' ({settings.redis_dir / 'broker_url'})"
            if origin == "published" else
            "default (ASYNCINFER_BROKER_URL unset, no 'asyncinfer up' running on this host)")
    if not settings.result_backend:
        sources["result_backend"] = "the broker URL"
    rows = [("broker_url", masked_url(settings.resolved_broker_url())),
            ("result_backend", masked_url(settings.resolved_result_backend()))]
    # each route's URL masked (a file's entries shown too)
    rows.append(("broker_routes", ";".join(f"{r.pattern}={masked_url(r.url)}"
                                           for r in settings.routes().entries)))
    for key, value in vars(settings).items():
        if key not in ("broker_url", "result_backend", "broker_routes"):
            rows.append((key, "**" if "password" in key and value else value))
    wide = max(len(str(value)) for _, value in rows)
    for key, value in rows:
        print(f"{key:26} {str(value):{min(wide, 40)}}  [{sources[key]}]")
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    from asyncinfer.config.settings import Settings
    from asyncinfer.gateway.server import Ports, run_gateway

    settings = Settings.from_env(broker_url=args.broker_url,
                                 allow_client_shm=getattr(args, "allow_client_shm", None),
                                 model_control_mode=getattr(args, "model_control_mode", None))
    ports = Ports(args.host or settings.gateway_host,
                  *(settings_value if flag is None else flag for flag, settings_value in (
                      (args.http_port, settings.http_port), (args.grpc_port, settings.grpc_port),
                      (args.metrics_port, settings.gateway_metrics_port))))
    processes = args.processes if args.processes is not None else settings.gateway_processes
    if processes:
        from asyncinfer.gateway.processes import run_gateway_processes

        return run_gateway_processes(settings, ports, processes)
    return run_gateway(settings, ports, reuse_port=args.reuse_port)


def cmd_models(args: argparse.Namespace) -> int:
    from asyncinfer.ops.models import format_models

    with _client(args) as client:
        client.ping()
        entries = client.models()
        if args.json:
            print(json.dumps({n: e.as_dict() for n, e in entries.items()}, sort_keys=True))
        else:
            print(format_models(entries))
    return 0


def cmd_model_control(args: argparse.Namespace) -> int:
    """``asyncinfer models load|unload M``: 0 when every worker asked did it, else 1 (each
    failure with its reason). A load's ``factory`` (``--factory pkg.mod:attr``): registered as
    ``M@VERSION`` on each worker first (worker/factory_loads.py)."""
    with _client(args) as client:
        client.ping()
        where = {"workers": _models(args.workers or ""), "devices": _models(args.devices or ""),
                 "version": args.version or None}
        if args.action == "load":
            outcome = client.load_model(args.model, **where, timeout_s=args.timeout_s,
                                        factory=getattr(args, "factory", None) or None)
        else:
            outcome = client.unload_model(args.model, **where, timeout_s=args.timeout_s,
                                          grace_s=args.grace_s)
        if args.json:
            print(json.dumps(outcome.as_dict(), sort_keys=True))
        else:
            print(outcome.message(), file=sys.stdout if outcome.ok else sys.stderr)
    return 0 if outcome.ok else 1


def cmd_stats(args: argparse.Namespace) -> int:
    from asyncinfer.ops.stats import format_stats

    with _client(args) as client:
        client.ping()
        if args.model and args.model not in client.models():
            print(f"model '{args.model}' is unknown: no worker announced it", file=sys.stderr)
            return 1
        stats = client.statistics(args.model)
        if args.json:
            print(json.dumps({"model_stats": stats}, sort_keys=True))
        else:
            print(format_stats(stats, workers=args.workers))
    return 0

