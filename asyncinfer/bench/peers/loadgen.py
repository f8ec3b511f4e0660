"""The peers' closed-loop load generator (runs in the peers venv): ``python -m
asyncinfer.bench.peers.loadgen --peer triton --port P --workload minilm --in-flight 1,256
--duration-s 8 --server-pid PID``.

For each in-flight level: N requests kept outstanding for the duration (asyncio: Triton's gRPC aio
client, or HTTP to Ray Serve's proxy), the same requests the bench sends asyncinfer. Prints one JSON
line per level: latencies, failures, elapsed time, the batch size each request ran in, and the CPU
seconds of this process and of the server's process tree over the run (and of each process named
with ``--cpu-pid NAME=PID``, under ``cpu_s``).

``--peer gateway`` (and ``gateway-http``) drive ``asyncinfer gateway`` the same way, from the
project's venv: Triton's gRPC aio client (or its HTTP aio client, binary tensors), the rows the
Python ``Client`` sends, the batch size read from the response's ``batch_size`` parameter.
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
#: What ``--peer`` takes: the peers, and the asyncinfer gateway's two fronts.
TARGETS = ("triton", "ray", "gateway", "gateway-http")


async def _grpc(port: int, workload: str, *, rows_as_columns: bool,
                batch_size: Callable[[Any], int]) -> tuple[Call, Callable[[], Awaitable[None]]]:
    """Calls through ``tritonclient.grpc.aio`` (Triton, and the gateway's gRPC front)."""
    import tritonclient.grpc.aio as grpcclient

    model = WORKLOADS[workload].model
    name, datatype, rows = request_rows(workload, 64)
    if rows_as_columns:  # PyTriton's BYTES input is [n, 1]
        rows = [r.reshape(1, 1) if datatype == "BYTES" else r for r in rows]
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")

    async def call(i: int) -> int:
        row = rows[i % len(rows)]
        tensor = grpcclient.InferInput(name, list(row.shape), datatype)
        tensor.set_data_from_numpy(row)
        return batch_size(await client.infer(model, [tensor]))

    return call, client.close


async def _triton(port: int, workload: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    return await _grpc(port, workload, rows_as_columns=True,
                       batch_size=lambda r: int(r.as_numpy("batch_size").reshape(-1)[0]))


def _grpc_parameter(parameter: Any) -> Any:
    """The plain value of a gRPC ``InferParameter`` (None when none of its fields is set)."""
    which = parameter.WhichOneof("parameter_choice")
    return None if which is None else getattr(parameter, which)


async def _gateway(port: int, workload: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    # the rows as the Python Client sends them; the batch size is a response parameter
    return await _grpc(port, workload, rows_as_columns=False, batch_size=lambda r: int(
        _grpc_parameter(r.get_response().parameters["batch_size"])))


async def _gateway_http(port: int, workload: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    import tritonclient.http.aio as httpclient

    model = WORKLOADS[workload].model
    name, datatype, rows = request_rows(workload, 64)
    # no limit below the bench's levels: one connection per request in flight
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{port}", conn_limit=1024)

    async def call(i: int) -> int:
        row = rows[i % len(rows)]
        tensor = httpclient.InferInput(name, list(row.shape), datatype)
        tensor.set_data_from_numpy(row, binary_data=True)
        result = await client.infer(model, [tensor])  # no outputs named: all, as binary data
        return int(result.get_response()["parameters"]["batch_size"])

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


def parse_cpu_pids(values: list[str]) -> dict[str, int]:
    """``--cpu-pid`` values (``NAME=PID``) as a mapping; ValueError for one of another form."""
    pids = {}
    for value in values:
        name, sep, pid = value.partition("=")
        if not sep or not name or not pid.isdigit():
            raise ValueError(f"--cpu-pid wants NAME=PID, got {value!r}")
        pids[name] = int(pid)
    return pids


_CONNECT = {"triton": _triton, "ray": _ray, "gateway": _gateway, "gateway-http": _gateway_http}


async def _main(args: argparse.Namespace) -> None:
    connect = _CONNECT[args.peer]
    others = parse_cpu_pids(args.cpu_pid)
    call, close = await connect(args.port, args.workload)
    try:
        for i in range(_WARM_UP):
            await call(i)
        # one full batch of each size a run meets first is slow (warm-up), as for asyncinfer
        await asyncio.gather(*(call(i) for i in range(model_options(args.workload).max_batch_size)))
        for level in (int(x) for x in args.in_flight.split(",")):
            client0, server0 = time.process_time(), tree_cpu_s(args.server_pid)
            others0 = {n: tree_cpu_s(pid) for n, pid in others.items()}
            result = await closed_loop(call, level, args.duration_s)
            result.update(peer=args.peer, workload=args.workload, level=level,
                          client_cpu_s=time.process_time() - client0,
                          server_cpu_s=tree_cpu_s(args.server_pid) - server0)
            if others:
                result["cpu_s"] = {n: tree_cpu_s(pid) - others0[n] for n, pid in others.items()}
            print(json.dumps(result), flush=True)
    finally:
        await close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--peer", choices=TARGETS, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--in-flight", default="1,8,64")
    p.add_argument("--duration-s", type=float, default=4.0)
    p.add_argument("--server-pid", type=int, required=True)
    p.add_argument("--cpu-pid", action="append", default=[], metavar="NAME=PID",
                   help="another process whose CPU seconds each line reports (cpu_s.NAME)")
    asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    main()
