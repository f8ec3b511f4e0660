"""What ``asyncinfer stats [M]`` shows: the fleet statistics (broker/fleet_stats.py) as tables."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["format_stats"]

#: The request-time columns: Triton's durations and the wait in Redis.
_TIMES = ("queue", "compute_input", "compute_infer", "compute_output", "redis_wait")


def _avg_ms(duration: Mapping[str, int]) -> str:
    """Mean milliseconds of a ``{"count", "ns"}`` duration (``-`` with no count)."""
    count = duration.get("count", 0)
    return f"{duration.get('ns', 0) / count / 1e6:.3f}" if count else "-"


def _row(label: str, stats: Mapping[str, Any], redis_wait: Mapping[str, int]) -> str:
    infer = stats["inference_stats"]
    times = {**infer, "redis_wait": redis_wait}
    return (f"{label:32} {stats['inference_count']:>10} {stats['execution_count']:>9} "
            f"{infer['success']['count']:>9} {infer['fail']['count']:>6} "
            + " ".join(f"{_avg_ms(times[t]):>10}" for t in _TIMES))


def _header(first: str) -> str:
    return (f"{first:32} {'INFERENCES':>10} {'BATCHES':>9} {'SUCCESS':>9} {'FAIL':>6} "
            + " ".join(f"{t.upper().replace('COMPUTE_', ''):>10}" for t in _TIMES))


def format_stats(model_stats: Iterable[Mapping[str, Any]], *, workers: bool = False) -> str:
    """Per model: counts and mean milliseconds per request (queue: held in the worker; input,
    infer, output: its batch's preprocess, device, postprocess; redis_wait: in Redis before a
    worker took it), then its batch sizes; ``workers``: a line per worker and per device too."""
    blocks = []
    for stats in model_stats:
        extra = stats.get("asyncinfer", {})
        lines = [_header("MODEL"), _row(stats["name"], stats, extra.get("redis_wait", {}))]
        if workers:
            lines += [_row(f"  {w['worker']} ({w['device']})", w, w.get("redis_wait", {}))
                      for w in extra.get("workers", [])]
            lines += [_row(f"  device {d['device']}", d, {}) for d in extra.get("devices", [])]
        if stats["batch_stats"]:
            lines.append(f"  {'BATCH SIZE':>10} {'BATCHES':>9} {'INPUT MS':>10} {'INFER MS':>10} "
                         f"{'OUTPUT MS':>10}")
            for b in stats["batch_stats"]:
                lines.append(f"  {b['batch_size']:>10} {b['compute_infer']['count']:>9} "
                             f"{_avg_ms(b['compute_input']):>10} {_avg_ms(b['compute_infer']):>10} "
                             f"{_avg_ms(b['compute_output']):>10}")
        blocks.append("\n".join(lines))
    if not blocks:
        return "(no statistics: no worker has counted a request yet)"
    return "\n\n".join(["(times: mean ms per request; per batch size: per batch)", *blocks])
