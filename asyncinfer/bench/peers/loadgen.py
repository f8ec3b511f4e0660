"""The peers' closed-loop load generator (runs in the peers venv): ``python -m
asyncinfer.bench.peers.loadgen --peer triton --port P --workload minilm --in-flight 1,256
--duration-s 8 --server-pid PID``.

For each in-flight level: N requests kept outstanding for the duration (asyncio: Triton's gRPC aio
client, or HTTP to Ray Serve's proxy), the same requests the bench sends asyncinfer. Prints one JSON
line per level: latencies, failures, elapsed time, the batch size each request ran in, and the CPU
seconds of this process and of the server's process tree over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from asyncinfer.bench.peers.host import tree_cpu_s
from asyncinfer.bench.peers.served import model_options, request_rows
from asyncinfer.bench.workloads import WORKLOADS

#: One request: send row ``i``, return the batch size it ran in.
Call = Callable[[int], Awaitable[int]]

_WARM_UP = 20


async def _triton(port: int, workload: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    import tritonclient.grpc.aio as grpcclient

    model = WORKLOADS[workload].model
    name, datatype, rows = request_rows(workload, 64)
    shaped = [r.reshape(1, 1) if datatype == "BYTES" else r for r in rows]
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")

    async def call(i: int) -> int:
        row = shaped[i % len(shaped)]
        tensor = grpcclient.InferInput(name, list(row.shape), datatype)
        tensor.set_data_from_numpy(row)
        result = await client.infer(model, [tensor])
        return int(result.as_numpy("batch_size").reshape(-1)[0])

    return call, client.close


async def _ray(port: int, workload: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    import aiohttp

    _, datatype, rows = request_rows(workload, 64)
    bodies = [json.dumps({"row": r[0].decode() if datatype == "BYTES" else r[0].tolist()}) for r in rows]
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    headers={"Content-Type": "application/json"})
    url = f"http://127.0.0.1:{port}/"

    async def call(i: int) -> int:
        async with session.post(url, data=bodies[i % len(bodies)]) as response:
            response.raise_for_status()
            return int((await response.json())["batch_size"])

    return call, session.close


async def closed_loop(call: Call, in_flight: int, duration_s: float) -> dict[str, Any]:
    """Keep ``in_flight`` calls outstanding for ``duration_s``; what completed, and how fast."""
    latencies: list[float] = []
    batches: Counter[int] = Counter()
    failures = 0
    began = time.perf_counter()
    deadline = began + duration_s
    counter = iter(range(1 << 62))

    async def lane() -> None:
        nonlocal failures
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                size = await call(next(counter))
            except Exception:  # noqa: BLE001 - a failed request is counted, not fatal
                failures += 1
                continue
            latencies.append((time.perf_counter() - started) * 1000.0)
            batches[size] += 1

    await asyncio.gather(*(lane() for _ in range(in_flight)))
    return {"latencies_ms": [round(x, 3) for x in latencies], "failures": failures,
            "elapsed_s": time.perf_counter() - began,
            "batch_sizes": {str(k): v for k, v in sorted(batches.items())}}


async def _main(args: argparse.Namespace) -> None:
    connect = _triton if args.peer == "triton" else _ray
    call, close = await connect(args.port, args.workload)
    try:
        for i in range(_WARM_UP):
            await call(i)
        # one full batch of each size a run meets first is slow (warm-up), as for asyncinfer
        await asyncio.gather(*(call(i) for i in range(model_options(args.workload).max_batch_size)))
        for level in (int(x) for x in args.in_flight.split(",")):
            client0, server0 = time.process_time(), tree_cpu_s(args.server_pid)
            result = await closed_loop(call, level, args.duration_s)
            result.update(peer=args.peer, workload=args.workload, level=level,
                          client_cpu_s=time.process_time() - client0,
                          server_cpu_s=tree_cpu_s(args.server_pid) - server0)
            print(json.dumps(result), flush=True)
    finally:
        await close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--peer", choices=("triton", "ray"), required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--in-flight", default="1,8,64")
    p.add_argument("--duration-s", type=float, default=4.0)
    p.add_argument("--server-pid", type=int, required=True)
    asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    main()
