"""Length-aware batching replayed against a cost model of MiniLM's batches: which rule pads less.

    .venv/bin/python bench/length_replay.py [--held 64,128,256] [--ratios 1.1,1.25,1.5,2]

Times MiniLM's three stages on one torch thread (each batch by its thread's CPU, so the host's
other load hardly enters) for batches of 1-32 rows × 8-192 padded tokens, fits ms a batch = a +
b·rows + c·rows·length + d·rows·length², then replays the ``Batcher`` (engine/batcher.py) on the
``minilm-mixed`` sentences in the load's order: a worker holding ``--held`` requests, each batch
replaced by as many new ones as it took. Prints ms a sentence by the model for each held × ratio,
with rows costed by characters and by tokens, beside the sorted limit's fixed-size batches. A
script, not a test: the fit moves with the host; compare only lines of one run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import torch

from asyncinfer.engine.batcher import Batcher, WorkItem
from asyncinfer.models.minilm import MiniLM
from asyncinfer.ops.benchmark.workloads import MIXED_SENTENCES, mixed_sentence


def fit_batch_ms(model: MiniLM) -> np.ndarray:
    """The fitted (a, b, c, d) of a batch's CPU ms, from timed batches of filler tokens."""
    rows_x, ms_y = [], []
    for length in (8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192):
        for rows in (1, 2, 4, 8, 16, 32):
            ids = torch.full((rows, length), 1000, dtype=torch.long)
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                     "token_type_ids": torch.zeros_like(ids)}
            batch = {name: batch[name] for name in model.input_names}
            reps = max(2, 2000 // (rows * length))
            with torch.inference_mode():
                model.postprocess(model.forward(batch))
                best = float("inf")
                for _ in range(3):
                    began = time.thread_time()
                    for _ in range(reps):
                        model.postprocess(model.forward(batch))
                    best = min(best, (time.thread_time() - began) / reps)
            rows_x.append([1, rows, rows * length, rows * length * length])
            ms_y.append(best * 1e3)
    x, y = np.array(rows_x, float), np.array(ms_y)
    return np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)[0]  # relative error


def replay(tokens: list[int], cost: Callable[[int], float], batch_ms: Callable[[int, int], float],
           held: int, ratio: float, sentences: int = 6000) -> dict[str, float]:
    """Ms a sentence, real tokens per padded one and the mean batch of the batcher's choices."""
    batcher = Batcher(32, 0.0, max_cost_ratio=ratio)
    sent = 0

    def arrive() -> None:
        nonlocal sent
        i = sent % len(tokens)
        sent += 1
        batcher.put(WorkItem(request=SimpleNamespace(id=str(sent), i=i), rows=1, signature=0,
                             cost=cost(i)))

    for _ in range(held):
        arrive()
    done = batches = real = padded = 0
    ms = 0.0
    while done < sentences:
        batch = batcher.next_batch() or []
        lengths = [tokens[item.request.i] for item in batch]
        ms += batch_ms(len(batch), max(lengths))
        real, padded = real + sum(lengths), padded + len(batch) * max(lengths)
        done, batches = done + len(batch), batches + 1
        for _ in batch:
            arrive()
    return {"ms": round(ms / done, 2), "real_per_padded": round(real / padded, 3),
            "mean_batch": round(done / batches, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--held", default="64,128,256")
    p.add_argument("--ratios", default="1.1,1.25,1.5,2")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = MiniLM()
    model.load(torch.device("cpu"))
    a, b, c, d = fit_batch_ms(model)
    print(f"ms a batch = {a:.2f} + {b:.3f}·rows + {c:.4f}·tokens + {d:.6f}·tokens·length")

    def batch_ms(rows: int, length: int) -> float:
        return float(a + b * rows + c * rows * length + d * rows * length * length)

    sentences = [mixed_sentence(i) for i in range(MIXED_SENTENCES)]
    tokens = [len(ids) for ids in model.tokenizer(sentences)["input_ids"]]
    by: dict[str, Callable[[int], float]] = {"characters": lambda i: float(len(sentences[i])),
                                             "tokens": lambda i: float(tokens[i])}
    for name, cost in by.items():
        order = sorted(range(len(sentences)), key=cost)
        limit = {size: round(sum(batch_ms(len(g), max(tokens[i] for i in g))
                                 for g in (order[k:k + size] for k in range(0, len(order), size)))
                             / len(order), 2) for size in (4, 8, 16, 32)}
        print(f"sorted limit by {name}, ms a sentence by batch size: {limit}")
        for held in (int(h) for h in args.held.split(",")):
            for ratio in (float(r) for r in args.ratios.split(",")):
                print(f"  by {name}, held {held}, ratio {ratio}:",
                      replay(tokens, cost, batch_ms, held, ratio))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
