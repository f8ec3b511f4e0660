"""Redis' memory for one large request, its tensors in the message against by reference.

    .venv/bin/python bench/tensor_refs_memory.py [--sizes-mb 8,16,32,200] [--out FILE]

Starts one embedded ``redis-server`` and one CPU worker of ``identity`` with a tensor store in a
temporary folder, then for each size sends one float32 request of that many MB (its output the
same size) twice: through its message (a client without a store; refused over the 64 MiB body
limit, as a user would see) and by reference (a client with the store). Prints, per run, how far
Redis' ``used_memory`` rose at its peak during the call (sampled every 10 ms) and after it, and
the call's seconds. A script, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncinfer.client import Client  # noqa: E402
from tests.support.local_fleet import MemoryPeak, local_fleet  # noqa: E402


def _run(url: str, store: str | None, size_mb: int) -> dict[str, object]:
    if store:
        os.environ["ASYNCINFER_TENSOR_STORE_URL"] = store
    try:
        client = Client(broker_url=url)
    finally:
        os.environ.pop("ASYNCINFER_TENSOR_STORE_URL", None)
    x = np.ones((1, size_mb * 2**20 // 4), np.float32)
    with client, MemoryPeak(client.broker, 0.01) as memory:
        began_s, outcome = time.monotonic(), "answered"
        try:
            answer = client.infer("identity", {"input": x}, timeout_s=300)
            assert answer["input"].shape == x.shape
        except Exception as exc:  # noqa: BLE001 - what a user sees: reported
            outcome = f"{type(exc).__name__}: {str(exc)[:120]}"
        took_s = time.monotonic() - began_s
    before, peak, after = memory.before, memory.peak, memory.after
    return {"size_mb": size_mb, "way": "by reference" if store else "in the message",
            "outcome": outcome, "seconds": round(took_s, 2),
            "redis_peak_growth_mb": round((peak - before) / 2**20, 2),
            "redis_after_growth_mb": round((after - before) / 2**20, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="8,16,32,200")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="tensor-store-") as store, \
            local_fleet("identity", "refs-bench@%h", ASYNCINFER_TENSOR_STORE_URL=store) as (url, _):
        for size_mb in (int(s) for s in args.sizes_mb.split(",")):
            for way in (None, store):
                run = _run(url, way, size_mb)
                print(json.dumps(run), flush=True)
                runs.append(run)
    if args.out:
        args.out.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
