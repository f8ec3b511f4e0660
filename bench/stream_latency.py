"""Time to the first and to the last part of a streaming request (the built-in ``echo-stream``),
through the ``Client``, the gateway's server-sent events and its gRPC stream, side by side with the
model's own limit.

    .venv/bin/python bench/stream_latency.py [--tokens 64] [--streams 1,64] [--rounds 5] \\
        [--step-s 0.01] [--out bench/results/stream_latency.jsonl]

One embedded Redis, one worker (``--device cpu``) hosting ``echo-stream`` and one gateway. Each
round starts ``N`` streams at once (``--streams``), each asking for ``--tokens`` words, and records
per stream the time from its start to its first part (TTFT) and to its last (TTLT). The limit is
the model alone, in this process: the same ``N`` rows as one batch, ``--tokens`` steps of
``--step-s``. Each system × ``N`` prints one JSON line (p50 and p90 of both, in ms). A script, not
a test: this machine is too noisy for timed assertions, so compare only lines of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from client_ab import wait_hosted  # this folder is first on sys.path when run as a script

from asyncinfer.ops.redis_server import RedisServer, free_port
from asyncinfer.supervision.processes import stop_process

MODEL = "echo-stream"
TEXT = "the quick brown fox jumps over the lazy dog"


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {"p50": round(statistics.median(ordered) * 1000, 2), "p90": round(p90 * 1000, 2)}


def _line(system: str, streams: int, firsts: list[float], lasts: list[float], parts: list[int],
          tokens: int) -> dict[str, Any]:
    wrong = sum(1 for n in parts if n != tokens)
    return {"system": system, "streams": streams, "ttft_ms": _percentiles(firsts),
            "ttlt_ms": _percentiles(lasts), "streams_timed": len(firsts), "wrong_part_counts": wrong}


def _limit(streams: int, tokens: int, step_s: float, rounds: int) -> dict[str, Any]:
    import numpy as np

    from asyncinfer.models.base import StreamRows
    from asyncinfer.models.registry import Registry

    model = Registry().create(MODEL)
    model.step_s = step_s
    firsts, lasts, parts = [], [], []
    for _ in range(rounds):
        batch = {"text_input": np.array([TEXT.encode()] * streams, dtype=object),
                 "max_tokens": np.full((streams,), tokens, dtype=np.int32)}
        start = time.perf_counter()
        seen = [0] * streams
        first: list[float | None] = [None] * streams
        last = [0.0] * streams
        rows = StreamRows(streams)
        for step in model.stream(batch, rows):
            now = time.perf_counter() - start
            rows.finished.update(step.done)
            for row in step.rows:
                seen[row] += 1
                first[row] = now if first[row] is None else first[row]
                last[row] = now
        firsts += [f for f in first if f is not None]
        lasts += last
        parts += seen
    return _line("limit (in process)", streams, firsts, lasts, parts, tokens)


def _client(url: str, streams: int, tokens: int, rounds: int) -> dict[str, Any]:
    from asyncinfer import Client

    firsts, lasts, parts = [], [], []
    lock = threading.Lock()
    with Client(broker_url=url) as client:
        def one() -> None:
            start = time.perf_counter()
            first, n = None, 0
            for _ in client.stream(MODEL, {"text_input": [TEXT], "max_tokens": [tokens]}):
                n += 1
                first = first if first is not None else time.perf_counter() - start
            with lock:
                firsts.append(first or 0.0)
                lasts.append(time.perf_counter() - start)
                parts.append(n)

        for _ in range(rounds):
            threads = [threading.Thread(target=one) for _ in range(streams)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    return _line("Client.stream", streams, firsts, lasts, parts, tokens)


async def _sse(http_port: int, streams: int, tokens: int, rounds: int) -> dict[str, Any]:
    import aiohttp

    firsts, lasts, parts = [], [], []
    url = f"http://127.0.0.1:{http_port}/v2/models/{MODEL}/generate_stream"
    async with aiohttp.ClientSession() as session:
        async def one() -> None:
            start = time.perf_counter()
            first, n = None, 0
            async with session.post(url, json={"text_input": TEXT, "max_tokens": tokens}) as resp:
                async for line in resp.content:
                    if line.startswith(b"data:"):
                        n += 1
                        first = first if first is not None else time.perf_counter() - start
            firsts.append(first or 0.0)
            lasts.append(time.perf_counter() - start)
            parts.append(n)

        for _ in range(rounds):
            await asyncio.gather(*(one() for _ in range(streams)))
    return _line("gateway generate_stream (SSE)", streams, firsts, lasts, parts, tokens)


async def _grpc(grpc_port: int, streams: int, tokens: int, rounds: int) -> dict[str, Any]:
    import numpy as np
    import tritonclient.grpc.aio as grpcclient

    firsts, lasts, parts = [], [], []

    def request(i: int) -> dict[str, Any]:
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([TEXT.encode()], dtype=object))
        limit = grpcclient.InferInput("max_tokens", [1], "INT32")
        limit.set_data_from_numpy(np.array([tokens], dtype=np.int32))
        return {"model_name": MODEL, "inputs": [text, limit], "request_id": f"bench-{i}"}

    async def one(client: Any, i: int) -> None:
        async def requests() -> Any:
            yield request(i)

        start = time.perf_counter()
        first, n = None, 0
        async for result, error in client.stream_infer(requests()):
            if error is not None:
                raise error
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param and not result.get_response().outputs:
                break
            n += 1
            first = first if first is not None else time.perf_counter() - start
        firsts.append(first or 0.0)
        lasts.append(time.perf_counter() - start)
        parts.append(n)

    clients = [grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") for _ in range(streams)]
    try:
        for r in range(rounds):
            await asyncio.gather(*(one(c, r * streams + i) for i, c in enumerate(clients)))
    finally:
        for c in clients:
            await c.close()
    return _line("gateway ModelStreamInfer (gRPC)", streams, firsts, lasts, parts, tokens)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--streams", default="1,64")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--step-s", type=float, default=0.01, help="the model's step time (its default)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    levels = [int(n) for n in args.streams.split(",")]
    lines = []
    with tempfile.TemporaryDirectory() as tmp, \
            RedisServer(Path(tmp) / "redis", appendonly=False) as redis:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
        env.update(ASYNCINFER_BROKER_URL=redis.url, ASYNCINFER_LOG_LEVEL="warning",
                   PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        worker = subprocess.Popen([sys.executable, "-m", "asyncinfer", "worker", "--device", "cpu",
                                   "--models", MODEL], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        http_port, grpc_port = free_port(), free_port()
        log = Path(tmp) / "gateway.log"
        gateway = subprocess.Popen(
            [sys.executable, "-m", "asyncinfer", "gateway", "--http-port", str(http_port),
             "--grpc-port", str(grpc_port), "--metrics-port", "0"], env=env,
            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        try:
            wait_hosted(redis.url, MODEL, worker)
            deadline = time.monotonic() + 60
            while "gateway ready" not in log.read_text(errors="replace"):
                if time.monotonic() > deadline or gateway.poll() is not None:
                    raise SystemExit(f"the gateway did not start: {log.read_text()[-2000:]}")
                time.sleep(0.2)
            for n in levels:
                lines.append(_limit(n, args.tokens, args.step_s, args.rounds))
                lines.append(_client(redis.url, n, args.tokens, args.rounds))
                lines.append(asyncio.run(_sse(http_port, n, args.tokens, args.rounds)))
                lines.append(asyncio.run(_grpc(grpc_port, n, args.tokens, args.rounds)))
                for line in lines[-4:]:
                    print(json.dumps(line), flush=True)
        finally:
            stop_process(gateway, signal.SIGTERM, 30)
            stop_process(worker, signal.SIGTERM, 30)
    if args.out:
        with open(args.out, "a") as f:
            for line in lines:
                f.write(json.dumps(dict(line, tokens=args.tokens, step_s=args.step_s)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
