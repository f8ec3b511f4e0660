"""The bench's CUDA mode with and without ``graph_batch_sizes``, alternated: for a GPU machine.

    .venv/bin/python bench/graphs_cuda.py [--device cuda:0] [--pairs 3] [--sizes 1,2,4,8,16,32] \\
        [--workloads mlp,deep-mlp] [--in-flight 1,8,64,256] [--duration-s 4] [--out FILE.jsonl]
    .venv/bin/python bench/graphs_cuda.py --dry-run      # on the CPU, seconds: the plumbing only

Two parts, each printing and writing one JSON line per measurement (``--parts``):

- ``device``: in this process, each workload's model on the device, eager against its graphs
  (engine/graphs.py, as a worker captures them), per batch size: milliseconds per batch from the
  host tensor to the host result (copy in, forward or replay, copy out, synchronise; the median
  of ``--iterations``), and the largest difference between the graph's answer and eager's over
  every row of a random batch of that size and of one row less (padded).
- ``served``: the bench's ``asyncinfer`` system (``asyncinfer worker --device DEVICE`` on one
  embedded Redis, its ``Client`` as the load, closed loop at each ``--in-flight``): the workload
  eager and with ``graph_batch_sizes``, alternated in pairs (A B, B A, ...), as this project
  measures every A/B. Throughput, p50, p99 and mean batch per run; the medians at the end.

Workloads: ``mlp`` (the built-in one: three small layers, ~10 kernels a batch) and ``deep-mlp``
(below: 24 layers of 256, ~50 kernels a batch: launch-bound on a GPU at small batches, where graphs
pay). ``--dry-run``: CPU, one pair, half-second runs at 1 and 8 in flight, two batch sizes —
on CPU the option is ignored (the worker logs one line), so this checks only that everything
starts, serves and is written; the speed-up needs the GPU. ``--dry-run --device npu:0`` under the
test suite's simulated NPU (tests/support/npu_sim/hook.py: its ``sitecustomize`` first on
``PYTHONPATH``) runs the graph path too, with the simulation's timings (meaningless as speed).

A script, not a test: compare only runs of one sitting; say when the machine was shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.models.base import Batch, InputSpec, Model, OutputSpec
from asyncinfer.models.builtin import MLP

HERE = Path(__file__).resolve().parent


class DeepMLP(Model):
    """``input`` FP32 [n, 16] → ``output`` FP32 [n, 4] through 24 hidden layers of 256 (fixed seed):
    many small kernels per batch, the shape a graph helps."""

    name = "deep-mlp"
    depth, width = 24, 256
    inputs = {"input": InputSpec(("FP32",), (MLP.in_features,), allow_nonfinite=False)}
    outputs = {"output": OutputSpec("FP32", (MLP.out_features,))}

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        layers: list[torch.nn.Module] = [torch.nn.Linear(MLP.in_features, self.width), torch.nn.ReLU()]
        for _ in range(self.depth):
            layers += [torch.nn.Linear(self.width, self.width), torch.nn.ReLU()]
        layers.append(torch.nn.Linear(self.width, MLP.out_features))
        self.net = torch.nn.Sequential(*layers)
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1]) ** 0.5)
        self.net.eval()

    def load(self, device: torch.device) -> None:
        self.net.to(device)

    def forward(self, batch: Batch) -> Batch:
        return {"output": self.net(batch["input"])}


#: ``ASYNCINFER_MODEL_FACTORIES`` entry of a worker that serves ``deep-mlp`` (this folder on its
#: ``PYTHONPATH``).
FACTORY = "deep-mlp=graphs_cuda:DeepMLP"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", help="default cuda:0 (cpu with --dry-run)")
    p.add_argument("--workloads", default="mlp,deep-mlp", help="of mlp, deep-mlp")
    p.add_argument("--sizes", default="1,2,4,8,16,32", help="graph_batch_sizes (max_batch_size 32)")
    p.add_argument("--parts", default="device,served", help="of device, served")
    p.add_argument("--pairs", type=int, default=3, help="served: eager/graphs pairs, alternated")
    p.add_argument("--in-flight", default="1,8,64,256", help="served: closed-loop levels")
    p.add_argument("--duration-s", type=float, default=4.0, help="served: seconds per run")
    p.add_argument("--iterations", type=int, default=200, help="device: batches per size and mode")
    p.add_argument("--out", default="bench-results/graphs_cuda.jsonl", help="JSON lines, appended")
    p.add_argument("--dry-run", action="store_true",
                   help="1 pair, 0.5 s runs at 1,8 in flight, sizes 1,4, on the CPU unless "
                        "--device says: the plumbing only")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device = args.device or "cpu"
        args.pairs, args.duration_s, args.in_flight = 1, 0.5, "1,8"
        args.sizes, args.iterations = "1,4", 5
    args.device = args.device or "cuda:0"
    args.sizes = sorted({int(s) for s in args.sizes.split(",")})
    args.levels = [int(x) for x in args.in_flight.split(",")]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workloads) - {"mlp", "deep-mlp"}
    if unknown:
        p.error(f"unknown workload(s) {sorted(unknown)}; known: mlp, deep-mlp")
    return args


def _model(name: str) -> Model:
    return DeepMLP() if name == "deep-mlp" else MLP()


def _options(sizes: list[int]) -> ModelOptions:
    return ModelOptions(max_batch_size=max(32, *sizes), graph_batch_sizes=tuple(sizes))


# -- device: in-process, eager against graphs ----------------------------------------------------

def _device_part(args: argparse.Namespace, emit: Any) -> None:
    from asyncinfer.engine.device import Device, bind_visible_device, parse_device
    from asyncinfer.engine.graphs import capture_graphs

    device = Device(bind_visible_device(parse_device(args.device)), label=args.device)
    device.bind_thread()
    for name in args.workloads:
        model = _model(name)
        model.load(device.torch_device)
        began = time.perf_counter()
        sets = capture_graphs(model, device, _options(args.sizes))
        capture_s = time.perf_counter() - began
        graphs = sets[0] if sets else None
        stream = device.new_stream()

        def eager(batch: Batch, model: Model = model) -> Batch:
            return _eager(model, device, batch)

        rng = np.random.default_rng(0)
        for size in args.sizes:
            x = torch.from_numpy(rng.standard_normal((size, MLP.in_features)).astype(np.float32))
            eager_ms = _ms_per_batch(device, stream, eager, x, args.iterations)
            line: dict[str, Any] = {"part": "device", "device": args.device, "workload": name,
                                    "batch_size": size, "eager_ms": eager_ms,
                                    "graphs": graphs is not None, "capture_s": round(capture_s, 2)}
            if graphs is not None:
                line["graph_ms"] = _ms_per_batch(device, stream, graphs.run, x, args.iterations)
                line["speedup"] = round(eager_ms / line["graph_ms"], 3)
                line["max_abs_diff"] = max(
                    _difference(device, stream, graphs.run, eager, x[:rows])
                    for rows in {size, max(1, size - 1)})
            emit(line)


def _eager(model: Model, device: Any, batch: Batch) -> Batch:
    return model.forward({n: device.to_device(v) for n, v in batch.items()})


def _one_batch(device: Any, stream: Any, run: Any, x: torch.Tensor) -> torch.Tensor:
    with device.on_stream(stream), torch.inference_mode():
        out = run({"input": x})
        host = device.to_host(out["output"])
        event = device.record_event(stream)
    if event is not None:
        event.synchronize()
    return host


def _ms_per_batch(device: Any, stream: Any, run: Any, x: torch.Tensor, iterations: int) -> float:
    for _ in range(3):
        _one_batch(device, stream, run, x)
    times = []
    for _ in range(iterations):
        began = time.perf_counter()
        _one_batch(device, stream, run, x)
        times.append((time.perf_counter() - began) * 1000)
    return round(statistics.median(times), 4)


def _difference(device: Any, stream: Any, run: Any, eager: Any, x: torch.Tensor) -> float:
    """The largest difference between ``run``'s answer and eager's, over every row of ``x``."""
    graph = _one_batch(device, stream, run, x)
    expected = _one_batch(device, stream, eager, x)
    assert graph.shape == expected.shape, (graph.shape, expected.shape)
    return float((graph - expected).abs().max())


# -- served: the bench's asyncinfer system, eager and graphs alternated ---------------------------

def _served_part(args: argparse.Namespace, emit: Any) -> None:
    from asyncinfer.client import Client
    from asyncinfer.ops.benchmark.measure import Run, closed_loop
    from asyncinfer.ops.benchmark.systems import payload_kwargs, start_system
    from asyncinfer.ops.benchmark.workloads import Workload
    from asyncinfer.ops.redis_server import RedisServer

    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")) if p)
    results: dict[tuple[str, str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="graphs-cuda-") as tmp:
        redis = RedisServer(Path(tmp) / "redis", appendonly=False).start()
        client = Client(broker_url=redis.url)
        try:
            for name in args.workloads:
                factories = FACTORY if name == "deep-mlp" else ""
                variants = {
                    "eager": Workload(name, name, "vector16", factories, {"max_batch_size": 32}),
                    "graphs": Workload(name, name, "vector16", factories, {
                        "max_batch_size": max(32, *args.sizes),
                        "graph_batch_sizes": args.sizes}),
                }
                for pair in range(args.pairs):
                    order = ["eager", "graphs"] if pair % 2 == 0 else ["graphs", "eager"]
                    for mode in order:
                        workload = variants[mode]
                        worker = start_system("asyncinfer", workload, redis.url, Path(tmp), 64,
                                              args.device)
                        try:
                            worker.wait_ready(client.app)
                            payloads = [payload_kwargs(workload, i) for i in range(64)]

                            def submit(i: int, w: Any = worker, p: Any = payloads) -> Any:
                                return client.send(w.task, w.queue, p[i % len(p)])

                            for i in range(20):  # warm up
                                submit(i).result(timeout=120)
                            for level in args.levels:
                                run = closed_loop(Run("asyncinfer", name, "closed", level), submit,
                                                  level, args.duration_s)
                                summary = run.summary()
                                results.setdefault((name, mode, level), []).append(
                                    summary["throughput_rps"])
                                emit({"part": "served", "device": args.device, "workload": name,
                                      "graphs": mode == "graphs", "pair": pair, **summary})
                            log = worker.log_path.read_text(errors="replace")
                            ignored = [ln for ln in log.splitlines() if "graph_batch_sizes" in ln]
                            if ignored:
                                emit({"part": "served", "worker_log": ignored})
                        finally:
                            worker.stop()
        finally:
            client.close()
            redis.stop()
    for (name, mode, level), rates in sorted(results.items()):
        emit({"part": "served-median", "device": args.device, "workload": name,
              "graphs": mode == "graphs", "level": level,
              "throughput_rps_median": round(statistics.median(rates), 1), "runs": rates})


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sitting = datetime.now(timezone.utc).isoformat(timespec="seconds")

    def emit(line: dict[str, Any]) -> None:
        line = {"sitting": sitting, **line}
        print(json.dumps(line), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")

    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if "device" in parts:
        _device_part(args, emit)
    if "served" in parts:
        _served_part(args, emit)
    print(f"written: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
