"""``asyncinfer dead list|show|requeue|purge MODEL``: a model's dead letters."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

__all__ = ["run_dead"]


def run_dead(args: argparse.Namespace) -> int:
    """Run one ``asyncinfer dead`` action; the exit status."""
    import redis

    from asyncinfer.config.settings import Settings
    from asyncinfer.worker.dead_letters import DeadLetters

    if args.action == "requeue" and bool(args.request_ids) == bool(args.all):
        print("asyncinfer dead requeue: name request IDs or --all (not both)", file=sys.stderr)
        return 2
    dead = DeadLetters.from_settings(Settings.from_env(broker_url=args.broker_url), args.model)
    try:
        if args.action == "list":
            for _, e in dead.entries():
                reason = " ".join(e.reason.split())
                print(f"{e.request_id}  {e.failed_at}  attempts={e.attempts}  {e.reason_type}: {reason}")
        elif args.action == "show":
            entry = dead.find(args.request_id)
            if entry is None:
                print(f"asyncinfer dead show: request {args.request_id} is not among the dead letters "
                      f"of model {args.model!r}", file=sys.stderr)
                return 1
            print(json.dumps(dataclasses.asdict(entry), indent=2))
        elif args.action == "requeue":
            done = dead.requeue(None if args.all else args.request_ids)
            print(f"requeued {len(done.requeued)}")
            for request_id in done.not_found:
                print(f"request {request_id} is not among the dead letters of model {args.model!r}",
                      file=sys.stderr)
            for why in done.refused.values():
                print(why, file=sys.stderr)
            return 1 if done.not_found or done.refused else 0
        else:
            print(f"purged {dead.purge()}")
    except redis.RedisError as exc:
        print(f"asyncinfer dead {args.action}: the broker failed ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 1
    return 0
