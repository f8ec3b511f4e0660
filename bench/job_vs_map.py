"""A job over a Parquet file against ``Client.map`` over the same rows, alternated in one sitting.

    .venv/bin/python bench/job_vs_map.py [--rows 20000] [--pairs 2] [--models minilm,mlp]
        [--out bench/results/job_vs_map_DATE.json]

Starts one embedded ``redis-server`` and one CPU worker hosting the models, writes each model's
rows to a Parquet file (minilm: a column of short sentences; mlp: a column of 16 floats), then for
each pair runs ``Client.map`` over the rows held in memory (the answers kept, as a user's loop
would) and ``Client.run_job`` from the file to a Parquet output, in turn. Prints one JSON line per
run (rows/s, seconds, how far the Redis' ``used_memory`` rose over its start at its peak) and the
job / map ratio per model. A script, not a test: this host is shared and noisy, so compare runs
of the same sitting only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncinfer.client import Client  # noqa: E402
from tests.support.local_fleet import MemoryPeak, local_fleet  # noqa: E402


def _rows(model: str, count: int) -> tuple[pa.Table, list[object]]:
    if model == "minilm":
        texts = [f"row {i}: a short sentence about the {i % 97}th thing" for i in range(count)]
        return pa.table({"text": texts}), [{"text": np.array([t], dtype=object)} for t in texts]
    values = np.random.default_rng(0).standard_normal((count, 16)).astype(np.float32)
    return (pa.table({"input": list(values)}),
            [{"input": values[i:i + 1]} for i in range(count)])


def _sitting(client: Client, model: str, rows: int, pairs: int, work: Path) -> list[dict[str, object]]:
    """``pairs`` of runs of ``model``: map, then a job, over the same ``rows``."""
    table, inputs = _rows(model, rows)
    source = work / f"{model}.parquet"
    pq.write_table(table, source)
    list(client.map(model, inputs[:256]))  # warm: the worker's first batches
    runs: list[dict[str, object]] = []
    for pair in range(pairs):
        for way in ("map", "job"):
            began_s = time.monotonic()
            with MemoryPeak(client.broker, 0.05) as memory:
                if way == "map":
                    assert len(list(client.map(model, inputs))) == rows
                else:
                    done = client.run_job(model, source, work / f"{model}-{pair}.parquet",
                                          progress=False)
                    assert done.rows == rows and done.failed == 0, done
            took_s = time.monotonic() - began_s
            run = {"model": model, "way": way, "pair": pair, "rows": rows,
                   "seconds": round(took_s, 2), "rows_per_s": round(rows / took_s, 1),
                   "redis_memory_growth_peak_mb": round((memory.peak - memory.before) / 2**20, 1)}
            print(json.dumps(run), flush=True)
            runs.append(run)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--models", default="minilm,mlp")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    models = args.models.split(",")
    runs: list[dict[str, object]] = []
    with local_fleet(",".join(models), "job-bench@%h") as (url, work), \
            Client(broker_url=url) as client:
        for model in models:
            runs += _sitting(client, model, args.rows, args.pairs, work)
    summary = {}
    for model in models:
        rate = {way: [r["rows_per_s"] for r in runs if r["model"] == model and r["way"] == way]
                for way in ("map", "job")}
        summary[model] = {"map_rows_per_s": rate["map"], "job_rows_per_s": rate["job"],
                          "job_over_map": round(sum(rate["job"]) / sum(rate["map"]), 3)}  # type: ignore[arg-type]
    print(json.dumps({"summary": summary}), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "summary": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
