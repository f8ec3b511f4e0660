"""The bench's outputs: JSON with every run, a Markdown table, a latency-vs-throughput plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_report", "markdown"]


#: The CPU columns (ms per request) of the closed-loop table: heading, run field.
_CPU = [("worker", "worker_cpu_ms_per_request"), ("client", "client_cpu_ms_per_request"),
        ("Redis", "redis_cpu_ms_per_request")]
#: Shown only when some run has it (the ``gateway`` systems).
_GATEWAY_CPU = ("gateway", "gateway_cpu_ms_per_request")


def markdown(doc: dict[str, Any]) -> str:
    """Closed-loop results and the targets as Markdown tables."""
    columns = list(_CPU)
    if any(run.get(_GATEWAY_CPU[1]) is not None for run in doc["runs"]):
        columns.append(_GATEWAY_CPU)
    rtt = (doc.get("meta") or {}).get("redis_rtt")
    lines = [f"Redis {rtt['measured_ms']:.2f} ms away (PING through the delay proxy; "
             f"{rtt['loopback_ms']:.2f} ms direct) from the {rtt['for']}.", ""] if rtt else []
    lines += ["| workload | system | in flight | req/s | share of limit | p50 ms | p95 ms | p99 ms | "
             "mean batch | CPU ms/req: " + " | ".join(h for h, _ in columns) + " |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(columns)]
    limits = {name: max(rates.values()) for name, rates in (doc.get("limits") or {}).items() if rates}
    for run in doc["runs"]:
        if run["mode"] != "closed":
            continue
        sizes = {int(k): v for k, v in run["batch_sizes"].items()}
        mean = sum(k * v for k, v in sizes.items()) / max(1, sum(sizes.values()))
        cpu = " | ".join("" if run.get(k) is None else f"{run[k]:.2f}" for _, k in columns)
        limit = limits.get(run["workload"])
        share = f"{run['throughput_rps'] / limit:.2f}" if limit else ""
        lines.append(f"| {run['workload']} | {run['system']} | {int(run['level'])} | "
                     f"{run['throughput_rps']:.1f} | {share} | {run['p50_ms']:.2f} | {run['p95_ms']:.2f} | "
                     f"{run['p99_ms']:.2f} | {mean:.1f} | {cpu} |")
    if doc.get("limits"):
        lines += ["", "| workload | in-process rows/s by batch size | best |", "|---|---|---:|"]
        for name, rates in doc["limits"].items():
            shown = ", ".join(f"{k}: {v:.0f}" for k, v in rates.items())
            lines.append(f"| {name} | {shown} | {max(rates.values()):.0f} |")
    if doc.get("targets"):
        lines += ["", "| target | measured | goal | met |", "|---|---:|---:|---|"]
        for t in doc["targets"]:
            lines.append(f"| {t['name']} | {t['value']:.3g} | {t['goal']} | "
                         f"{'yes' if t['met'] else '**no**'} |")
    return "\n".join(lines)


def _plot(doc: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    workloads = list(dict.fromkeys(r["workload"] for r in doc["runs"]))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.8 * len(workloads), 4.2), squeeze=False)
    for ax, name in zip(axes[0], workloads, strict=True):
        latencies: list[float] = []
        for i, system in enumerate(sorted({r["system"] for r in doc["runs"] if r["workload"] == name})):
            color = f"C{i}"
            for mode, marker in (("closed", "o-"), ("open", "s:")):
                runs = sorted((r for r in doc["runs"] if r["workload"] == name
                               and r["system"] == system and r["mode"] == mode
                               and r["failures"] == 0), key=lambda r: r["throughput_rps"])
                if not runs:
                    continue
                xs = [r["throughput_rps"] for r in runs]
                p50 = [r["p50_ms"] for r in runs]
                latencies += p50 + [r["p99_ms"] for r in runs]
                ax.plot(xs, p50, marker, color=color, label=f"{system} p50 ({mode} loop)")
                if mode == "closed":
                    ax.plot(xs, [r["p99_ms"] for r in runs], "x--", color=color, alpha=0.6,
                            label=f"{system} p99")
                    for x, y, r in zip(xs, p50, runs, strict=True):  # each point: its in-flight level
                        ax.annotate(f"{int(r['level'])}", (x, y), textcoords="offset points",
                                    xytext=(3, 4), fontsize=7, color=color)
        limit = max((doc.get("limits") or {}).get(name, {}).values(), default=0.0)
        shown = [r["throughput_rps"] for r in doc["runs"] if r["workload"] == name]
        if limit and shown and limit < 3 * max(shown):  # the in-process limit, where it fits
            ax.axvline(limit, color="grey", linestyle="-.", linewidth=1,
                       label=f"in-process limit {limit:.0f}/s")
        ax.set_title(f"{name} (closed-loop points: requests in flight)", fontsize=9)
        ax.set_xlabel("throughput (req/s)")
        ax.set_ylabel("latency (ms)")
        positive = [v for v in latencies if v > 0]
        if positive and max(positive) / min(positive) > 20:  # log only where the range is wide
            ax.set_yscale("log")
        else:
            ax.ticklabel_format(axis="y", style="plain", useOffset=False)
        ax.ticklabel_format(axis="x", style="plain", useOffset=False)
        ax.margins(x=0.08, y=0.12)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write ``bench.json``, ``bench.md`` and ``bench.png`` (when matplotlib is there)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "bench.json", out_dir / "bench.md"]
    written[0].write_text(json.dumps(doc, indent=1))
    written[1].write_text(markdown(doc) + "\n")
    if _plot(doc, out_dir / "bench.png"):
        written.append(out_dir / "bench.png")
    return written
