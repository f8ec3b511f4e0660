"""The bench's outputs: JSON with every run, a Markdown table, a latency-vs-throughput plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_report", "markdown"]


def markdown(doc: dict[str, Any]) -> str:
    """Closed-loop results and the targets as Markdown tables."""
    lines = ["| workload | system | in flight | req/s | p50 ms | p95 ms | p99 ms | mean batch | "
             "CPU ms/req: worker | client | Redis |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in doc["runs"]:
        if run["mode"] != "closed":
            continue
        sizes = {int(k): v for k, v in run["batch_sizes"].items()}
        mean = sum(k * v for k, v in sizes.items()) / max(1, sum(sizes.values()))
        cpu = " | ".join("" if run.get(k) is None else f"{run[k]:.2f}" for k in (
            "worker_cpu_ms_per_request", "client_cpu_ms_per_request", "redis_cpu_ms_per_request"))
        lines.append(f"| {run['workload']} | {run['system']} | {int(run['level'])} | "
                     f"{run['throughput_rps']:.1f} | {run['p50_ms']:.2f} | {run['p95_ms']:.2f} | "
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
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 4), squeeze=False)
    for ax, name in zip(axes[0], workloads, strict=True):
        for system in sorted({r["system"] for r in doc["runs"] if r["workload"] == name}):
            runs = sorted((r for r in doc["runs"] if r["workload"] == name and r["system"] == system
                           and r["failures"] == 0), key=lambda r: r["throughput_rps"])
            xs = [r["throughput_rps"] for r in runs]
            ax.plot(xs, [r["p50_ms"] for r in runs], "o-", label=f"{system} p50")
            ax.plot(xs, [r["p99_ms"] for r in runs], "x--", label=f"{system} p99")
        ax.set_title(name)
        ax.set_xlabel("throughput (req/s)")
        ax.set_ylabel("latency (ms)")
        ax.set_yscale("log")
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
