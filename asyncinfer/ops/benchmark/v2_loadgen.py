"""The bench's closed-loop load generator over the v2 protocol, in a process of its own:
``python -m asyncinfer.ops.benchmark.v2_loadgen --target gateway --port P --workload minilm
--in-flight 1,256 --duration-s 8 --server-pid PID``.

For each in-flight level: N requests kept outstanding for the duration (asyncio), the same rows
the Python ``Client`` sends. Prints one JSON line per level: latencies, failures, elapsed time,
the batch size each request ran in, and the CPU seconds of this process and of the server's
process tree over the run (and of each process named with ``--cpu-pid NAME=PID``, under
``cpu_s``).

``--target gateway`` (and ``gateway-http``) drive ``asyncinfer gateway`` with Triton's own gRPC
aio client (or its HTTP aio client, binary tensors); the batch size is read from the response's
``batch_size`` parameter. The peers' load generator (``bench/peers/loadgen.py`` of a source
checkout, run in the peers' venv) is this one with targets of its own: ``main(connectors=...)``.

The bench's side of it: ``run_load`` starts a generator and turns each line it prints into the
bench's ``Run`` (``run_from_line``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.models.registry import Registry
from asyncinfer.ops.benchmark.host import tree_cpu_s
from asyncinfer.ops.benchmark.measure import Run
from asyncinfer.ops.benchmark.workloads import WORKLOADS, Workload
from asyncinfer.wire.protocol import decode_request

__all__ = ["Call", "Connect", "CONNECTORS", "TARGETS", "MODULE", "closed_loop", "grpc_connector",
           "grpc_parameter", "model_options", "request_rows", "parse_cpu_pids", "main",
           "run_from_line", "run_load", "child_env"]

#: One request: send row ``i``, return the batch size it ran in.
Call = Callable[[int], Awaitable[int]]
#: A target's connector: ``(port, workload)`` → its call and how to close it.
Connect = Callable[[int, str], Awaitable[tuple[Call, Callable[[], Awaitable[None]]]]]
#: This generator's module (``python -m``).
MODULE = "asyncinfer.ops.benchmark.v2_loadgen"

_WARM_UP = 20


def _workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    return WORKLOADS[name]


def model_options(workload_name: str) -> ModelOptions:
    """The workload's model's batching options (max batch, max delay), without loading it."""
    workload = _workload(workload_name)
    registry = Registry.from_config([workload.factories] if workload.factories else [])
    return registry.create(workload.model).options


def request_rows(workload_name: str, count: int | None = None) -> tuple[str, str, list[np.ndarray]]:
    """The input name, its v2 datatype and ``count`` one-row numpy values of the workload's
    requests (BYTES as UTF-8 ``bytes``; default: as many as the load cycles through): the same
    requests the bench sends asyncinfer."""
    workload = _workload(workload_name)
    count = workload.distinct_payloads if count is None else count
    rows, name, datatype = [], "", ""
    for i in range(count):
        request = decode_request(f"load-{i}", {"model": workload.model, **workload.payload(i)})
        (tensor,) = request.inputs
        name, datatype = tensor.name, tensor.datatype
        if datatype == "BYTES":
            value = np.array([s.encode() if isinstance(s, str) else s for s in tensor.value], dtype=object)
        else:
            value = np.asarray(tensor.value)
        rows.append(value)
    return name, datatype, rows


async def grpc_connector(port: int, workload: str, *, rows_as_columns: bool,
                         batch_size: Callable[[Any], int]) -> tuple[Call, Callable[[], Awaitable[None]]]:
    """Calls through ``tritonclient.grpc.aio`` (the gateway's gRPC front, and Triton's):
    ``rows_as_columns`` sends a BYTES row as [1, 1] (PyTriton's shape); ``batch_size`` reads the
    batch size from a result."""
    import tritonclient.grpc.aio as grpcclient

    model = WORKLOADS[workload].model
    name, datatype, rows = request_rows(workload)
    if rows_as_columns:
        rows = [r.reshape(1, 1) if datatype == "BYTES" else r for r in rows]
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}")

    async def call(i: int) -> int:
        row = rows[i % len(rows)]
        tensor = grpcclient.InferInput(name, list(row.shape), datatype)
        tensor.set_data_from_numpy(row)
        return batch_size(await client.infer(model, [tensor]))

    return call, client.close


def grpc_parameter(parameter: Any) -> Any:
    """The plain value of a gRPC ``InferParameter`` (None when none of its fields is set)."""
    which = parameter.WhichOneof("parameter_choice")
    return None if which is None else getattr(parameter, which)


async def _gateway(port: int, workload: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    # the rows as the Python Client sends them; the batch size is a response parameter
    return await grpc_connector(port, workload, rows_as_columns=False, batch_size=lambda r: int(
        grpc_parameter(r.get_response().parameters["batch_size"])))


async def _gateway_http(port: int, workload: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    import tritonclient.http.aio as httpclient

    model = WORKLOADS[workload].model
    name, datatype, rows = request_rows(workload)
    # no limit below the bench's levels: one connection per request in flight
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{port}", conn_limit=1024)

    async def call(i: int) -> int:
        row = rows[i % len(rows)]
        tensor = httpclient.InferInput(name, list(row.shape), datatype)
        tensor.set_data_from_numpy(row, binary_data=True)
        result = await client.infer(model, [tensor])  # no outputs named: all, as binary data
        return int(result.get_response()["parameters"]["batch_size"])

    return call, client.close


#: What ``--target`` takes here: the asyncinfer gateway's two fronts.
CONNECTORS: dict[str, Connect] = {"gateway": _gateway, "gateway-http": _gateway_http}
TARGETS = tuple(CONNECTORS)


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


async def _main(args: argparse.Namespace, connect: Connect) -> None:
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
            result.update(target=args.target, workload=args.workload, level=level,
                          client_cpu_s=time.process_time() - client0,
                          server_cpu_s=tree_cpu_s(args.server_pid) - server0)
            if others:
                result["cpu_s"] = {n: tree_cpu_s(pid) - others0[n] for n, pid in others.items()}
            print(json.dumps(result), flush=True)
    finally:
        await close()


def main(argv: Sequence[str] | None = None, connectors: Mapping[str, Connect] = CONNECTORS) -> None:
    """Run the generator against one of ``connectors`` (``--target``)."""
    p = argparse.ArgumentParser()
    p.add_argument("--target", choices=list(connectors), required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--in-flight", default="1,8,64")
    p.add_argument("--duration-s", type=float, default=4.0)
    p.add_argument("--server-pid", type=int, required=True)
    p.add_argument("--cpu-pid", action="append", default=[], metavar="NAME=PID",
                   help="another process whose CPU seconds each line reports (cpu_s.NAME)")
    args = p.parse_args(argv)
    asyncio.run(_main(args, connectors[args.target]))


# --- the bench's side ------------------------------------------------------------------------

#: A process's name in a generator's line → the ``Run`` field of its CPU ms per request.
_CPU_COLUMNS = {"worker": "worker_cpu_ms_per_request", "gateway": "gateway_cpu_ms_per_request",
                "client": "client_cpu_ms_per_request", "redis": "redis_cpu_ms_per_request"}


def run_from_line(system: str, workload: str, line: str, server: str = "worker") -> Run:
    """One JSON line of a load generator as the bench's ``Run`` (closed loop).

    The server's processes take the ``server`` CPU column (``worker`` for a peer; ``gateway`` for
    ``asyncinfer gateway``), the generator the ``client`` one; the processes of the line's
    ``cpu_s`` (``worker``, ``redis``) take their own columns; a peer has no Redis. Raises
    ValueError on a line that is not such a result."""
    if server not in _CPU_COLUMNS:
        raise ValueError(f"unknown CPU column {server!r}; known: {', '.join(_CPU_COLUMNS)}")
    try:
        doc: dict[str, Any] = json.loads(line)
        latencies = [float(x) for x in doc["latencies_ms"]]
        run = Run(system, workload, "closed", int(doc["level"]), latencies_ms=latencies,
                  failures=int(doc["failures"]), elapsed_s=float(doc["elapsed_s"]),
                  batch_sizes=Counter({int(k): int(v) for k, v in doc["batch_sizes"].items()}))
        n = max(1, len(latencies))
        seconds = {server: float(doc["server_cpu_s"]), "client": float(doc["client_cpu_s"])}
        seconds.update({k: float(v) for k, v in (doc.get("cpu_s") or {}).items() if k in _CPU_COLUMNS})
        for column, value in seconds.items():
            setattr(run, _CPU_COLUMNS[column], value * 1000.0 / n)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a load generator result line: {line[:200]!r} ({exc})") from exc
    run.rows = len(latencies)
    return run


def child_env() -> dict[str, str]:
    """This process's environment less asyncinfer's settings, for a generator or a peer."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def run_load(generator: Sequence[str | Path], target: str, port: int, workload: str,
             levels: list[int], duration_s: float, server_pid: int, log_dir: Path, *,
             server: str = "worker", cpu_pids: dict[str, int] | None = None,
             env: dict[str, str] | None = None) -> list[Run]:
    """Run the load generator ``generator`` (its command, up to its options) against ``target``
    on ``port``: one closed-loop ``Run`` per in-flight level (``server`` names the CPU column of
    ``server_pid``)."""
    argv = [str(a) for a in generator] + [
        "--target", target, "--port", str(port), "--workload", workload,
        "--in-flight", ",".join(str(n) for n in levels), "--duration-s", str(duration_s),
        "--server-pid", str(server_pid)]
    argv += [a for name, pid in (cpu_pids or {}).items() for a in ("--cpu-pid", f"{name}={pid}")]
    log = log_dir / f"{target}-{workload}-loadgen.log"
    timeout_s = 300 + len(levels) * (duration_s + 60)
    with open(log, "wb") as err:
        done = subprocess.run(argv, env=child_env() if env is None else env, stdout=subprocess.PIPE,
                              stderr=err, stdin=subprocess.DEVNULL, timeout=timeout_s, check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{target} load generator exited {done.returncode}: {tail}")
    lines = [x for x in done.stdout.decode().splitlines() if x.startswith("{")]
    return [run_from_line(target, workload, x, server) for x in lines]


if __name__ == "__main__":
    main()
