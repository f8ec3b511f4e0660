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
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncinfer.client import Client  # noqa: E402
from asyncinfer.ops.redis_server import RedisServer  # noqa: E402
from tests.support.processes import start_worker  # noqa: E402


def _run(url: str, store: str | None, size_mb: int) -> dict[str, object]:
    if store:
        os.environ["ASYNCINFER_TENSOR_STORE_URL"] = store
    try:
        client = Client(broker_url=url)
    finally:
        os.environ.pop("ASYNCINFER_TENSOR_STORE_URL", None)
    x = np.ones((1, size_mb * 2**20 // 4), np.float32)
    with client:
        redis = client.broker
        before = int(redis.info("memory")["used_memory"])
        peak, stop = [before], threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], int(redis.info("memory")["used_memory"]))
                stop.wait(0.01)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        began_s, outcome = time.monotonic(), "answered"
        try:
            answer = client.infer("identity", {"input": x}, timeout_s=300)
            assert answer["input"].shape == x.shape
        except Exception as exc:  # noqa: BLE001 - what a user sees: reported
            outcome = f"{type(exc).__name__}: {str(exc)[:120]}"
        took_s = time.monotonic() - began_s
        stop.set()
        thread.join()
        after = int(redis.info("memory")["used_memory"])
    return {"size_mb": size_mb, "way": "by reference" if store else "in the message",
            "outcome": outcome, "seconds": round(took_s, 2),
            "redis_peak_growth_mb": round((peak[0] - before) / 2**20, 2),
            "redis_after_growth_mb": round((after - before) / 2**20, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="8,16,32,200")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tensor-refs-"))
    store = str(work / "store")
    server = RedisServer(work / "redis", appendonly=False).start()
    worker = start_worker(server.url, work / "worker.log", "--device", "cpu", "--models",
                          "identity", "--hostname", "refs-bench@%h",
                          ASYNCINFER_TENSOR_STORE_URL=store)
    runs = []
    try:
        for size_mb in (int(s) for s in args.sizes_mb.split(",")):
            for way in (None, store):
                run = _run(server.url, way, size_mb)
                print(json.dumps(run), flush=True)
                runs.append(run)
    finally:
        worker.stop()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
