"""The gateway's cost per call as a figure the host's noise does not move: instructions (callgrind).

    .venv/bin/python bench/gateway_instructions.py [--calls 300] [--warmup 100] [--in-flight 1,8] \\
        [--repeats 2] [--skip-cpu] [--skip-callgrind] [--threads] [--profile] [--top 25] [--keep DIR]

One embedded Redis, one CPU worker hosting ``identity`` and ``mlp``, and ``asyncinfer gateway``
under ``valgrind --tool=callgrind --instr-atstart=no``: start-up runs uninstrumented, and
collection is switched on (``callgrind_control -z``, ``-i on``) only around the measured calls of
one window and dumped after it (``-i off``, ``-d``). Each window is ``--calls`` calls of one model
through one front (``tritonclient.grpc.aio``, ``tritonclient.http.aio`` with binary tensors) at
each of ``--in-flight`` calls in flight, after ``--warmup`` calls; it prints the window's
instructions (Ir, every thread of the gateway) per call. Every window runs ``--repeats`` times, to
show the figure repeats: at 1 in flight to 0.1 % whatever else runs on the host (each call takes
the same path); with several in flight to 1-3 %, since how calls share loop turns and publish
groups depends on timing.

Then, unless ``--skip-cpu``, the same windows against a gateway outside valgrind, for its CPU
time per call (user + system, /proc, ten times the calls: the clock ticks are 10 ms). With
``--profile``, a third gateway runs under cProfile switched on only around the windows
(SIGUSR1 on, SIGUSR2 off and dump), and the top Python functions by own time per call are
listed. Every process this script starts it stops by its PID. A script, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from client_ab import wait_hosted  # this folder is first on sys.path when run as a script

from asyncinfer.ops.benchmark.host import tree_cpu_s, tree_system_cpu_s
from asyncinfer.ops.benchmark.v2_loadgen import request_rows
from asyncinfer.ops.redis_server import RedisServer, free_port
from asyncinfer.supervision.processes import stop_process

HERE = Path(__file__).resolve().parents[1]
MODELS = ("identity", "mlp")
FRONTS = ("grpc", "http")
_PROFILED = "--profiled-gateway"  # argv[1] of this script when it runs as the profiled gateway


def _env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
    env.update(ASYNCINFER_BROKER_URL=url, ASYNCINFER_LOG_LEVEL="warning",
               ASYNCINFER_CONCURRENCY="1", PYTHONPATH=str(HERE))
    return env


def _gateway(url: str, prefix: list[str], log: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    """``asyncinfer gateway`` run behind ``prefix`` (valgrind, or nothing); its (process, gRPC
    port, HTTP port) once its log says it is ready."""
    grpc_port, http_port = free_port(), free_port()
    argv = [*prefix, "-m", "asyncinfer", "gateway", "--http-port", str(http_port),
            "--grpc-port", str(grpc_port), "--metrics-port", "0"]
    if prefix[-1] == _PROFILED:  # it runs ``asyncinfer`` itself
        argv.remove("-m")
        argv.remove("asyncinfer")
    process = subprocess.Popen(argv, env=_env(url), stdout=open(log, "wb"),
                               stderr=subprocess.STDOUT, cwd=HERE)
    deadline = time.monotonic() + 600  # under valgrind the start takes a minute or more
    while "gateway ready" not in log.read_text(errors="replace"):
        if time.monotonic() > deadline or process.poll() is not None:
            stop_process(process, signal.SIGTERM, 10)
            raise SystemExit(f"the gateway did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    return process, grpc_port, http_port


Call = Callable[[int], Awaitable[None]]


async def _callers(grpc_port: int, http_port: int) -> tuple[dict[tuple[str, str], Call],
                                                            Callable[[], Awaitable[None]]]:
    import tritonclient.grpc.aio as grpcclient
    import tritonclient.http.aio as httpclient

    grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    http_client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", conn_limit=64,
                                                   conn_timeout=600.0)
    calls: dict[tuple[str, str], Call] = {}
    for model in MODELS:
        name, datatype, rows = request_rows(model, 64)

        async def grpc_call(i: int, model: str = model, name: str = name, datatype: str = datatype,
                            rows: list[Any] = rows) -> None:
            tensor = grpcclient.InferInput(name, list(rows[i % len(rows)].shape), datatype)
            tensor.set_data_from_numpy(rows[i % len(rows)])
            await grpc_client.infer(model, [tensor], client_timeout=600.0)

        async def http_call(i: int, model: str = model, name: str = name, datatype: str = datatype,
                            rows: list[Any] = rows) -> None:
            tensor = httpclient.InferInput(name, list(rows[i % len(rows)].shape), datatype)
            tensor.set_data_from_numpy(rows[i % len(rows)], binary_data=True)
            result = await http_client.infer(model, [tensor])
            result.get_response()

        calls[("grpc", model)] = grpc_call
        calls[("http", model)] = http_call

    async def close() -> None:
        await grpc_client.close()
        await http_client.close()

    return calls, close


async def _drive(call: Call, count: int, in_flight: int) -> None:
    """``count`` calls, ``in_flight`` at a time; any failure stops the script."""
    next_i = 0

    async def lane() -> None:
        nonlocal next_i
        while next_i < count:
            i, next_i = next_i, next_i + 1
            await call(i)

    await asyncio.gather(*(lane() for _ in range(in_flight)))


def _callgrind(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def _dumped_ir(out: str, before: set[str], keep: Path | None, name: str,
               count: int = 1) -> int:
    """The Ir total of the dump files that appeared since ``before`` (one, or one a thread under
    ``--separate-threads``: each thread's share per call, of ``count`` calls, is printed), copied
    to ``keep``/``name`` when given, for ``callgrind_annotate``."""
    deadline = time.monotonic() + 60
    while True:
        totals: dict[str, int] = {}
        for path in sorted(set(glob.glob(out + "*")) - before):
            text = Path(path).read_text(errors="replace")
            for line in text.splitlines():
                if line.startswith("totals:"):  # (its "summary:" reads 0 after a zero)
                    totals[path] = int(line.split()[1])
                    if keep is not None:
                        keep.mkdir(parents=True, exist_ok=True)
                        (keep / f"{name}{path[len(out):]}").write_text(text)
        if totals:
            time.sleep(0.5)  # the other threads' dumps of the same moment
            if len(totals) == len(set(glob.glob(out + "*")) - before):
                if len(totals) > 1:
                    shares = ", ".join(f"{p[len(out):]} {ir / count:,.0f}"
                                       for p, ir in sorted(totals.items(), key=lambda t: -t[1]))
                    print(f"    by thread (Ir/call): {shares}", flush=True)
                return sum(totals.values())
        if time.monotonic() > deadline:
            raise SystemExit(f"no callgrind dump appeared ({sorted(totals)})")
        time.sleep(0.2)


async def _windows(args: argparse.Namespace, process: subprocess.Popen[bytes], grpc_port: int,
                   http_port: int, kind: str, out: str = "") -> dict[tuple[str, str, int], list[float]]:
    """Each (front, model, in flight) window ``--repeats`` times; per window the figure per call: Ir
    (``kind`` callgrind), CPU ms (cpu) or nothing (profile: the profile is the result)."""
    calls, close = await _callers(grpc_port, http_port)
    figures: dict[tuple[str, str, int], list[float]] = {}
    count = args.calls * (10 if kind == "cpu" else 1)
    try:
        for call in calls.values():
            await _drive(call, args.warmup, max(args.in_flight))
        for repeat, in_flight, (key, call) in ((r, n, c) for r in range(args.repeats)
                                               for n in args.in_flight for c in calls.items()):
            await _drive(call, args.warmup // 4, in_flight)  # this window's connections warm
            if kind == "callgrind":
                before = set(glob.glob(out + "*"))
                _callgrind(process.pid, "-z")
                _callgrind(process.pid, "-i", "on")
            elif kind == "profile":
                os.kill(process.pid, signal.SIGUSR1)
                await asyncio.sleep(0.2)
            cpu0, system0 = tree_cpu_s(process.pid), tree_system_cpu_s(process.pid)
            t0 = time.monotonic()
            await _drive(call, count, in_flight)
            elapsed = time.monotonic() - t0
            cpu_s = tree_cpu_s(process.pid) - cpu0
            system_s = tree_system_cpu_s(process.pid) - system0
            if kind == "callgrind":
                _callgrind(process.pid, "-i", "off")
                _callgrind(process.pid, "-d")
                name = f"callgrind.{key[0]}.{key[1]}.{in_flight}.{repeat + 1}"
                figure = _dumped_ir(out, before, args.keep, name, count) / count
                print(f"  {kind} run {repeat + 1} {key[0]:4} {key[1]:8} {in_flight:3}: "
                      f"{figure:12,.0f} Ir/call ({elapsed:.1f} s)", flush=True)
            elif kind == "cpu":
                figure = cpu_s * 1e3 / count
                print(f"  {kind} run {repeat + 1} {key[0]:4} {key[1]:8} {in_flight:3}: "
                      f"{figure:.3f} ms/call, {system_s * 1e3 / count:.3f} of it system "
                      f"({count / elapsed:.0f} calls/s)", flush=True)
            else:
                os.kill(process.pid, signal.SIGUSR2)
                await asyncio.sleep(1.0)
                figure = 0.0
            figures.setdefault((*key, in_flight), []).append(figure)
    finally:
        await close()
    return figures


def _profiled_gateway(argv: list[str]) -> None:
    """Run ``asyncinfer gateway argv`` with cProfile on between SIGUSR1 and SIGUSR2; each SIGUSR2
    adds the window to the stats file named by GATEWAY_PROFILE_OUT (one per window: .N)."""
    import cProfile
    import runpy

    profile = cProfile.Profile()
    windows = 0

    def on(_signum: int, _frame: Any) -> None:
        profile.enable()

    def off(_signum: int, _frame: Any) -> None:
        nonlocal windows
        profile.disable()
        windows += 1
        profile.dump_stats(f"{os.environ['GATEWAY_PROFILE_OUT']}.{windows}")
        profile.clear()

    signal.signal(signal.SIGUSR1, on)
    signal.signal(signal.SIGUSR2, off)
    sys.argv = ["asyncinfer", *argv]
    runpy.run_module("asyncinfer", run_name="__main__", alter_sys=True)


def _print_profile(path_prefix: str, calls: int, top: int) -> None:
    paths = sorted(glob.glob(path_prefix + ".[0-9]*"))
    if not paths:
        print("  no profile was written")
        return
    stats = pstats.Stats(paths[0])
    for path in paths[1:]:
        stats.add(path)
    total_calls = calls * len(paths)
    rows = []
    for (filename, line, name), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        short = filename.replace(str(HERE) + "/", "").split("site-packages/")[-1]
        rows.append((tottime, cumtime, ncalls, f"{short}:{line}({name})"))
    rows.sort(reverse=True)
    whole = sum(r[0] for r in rows)
    print(f"  profiled: {whole * 1e6 / total_calls:.0f} µs of Python-visible time per call "
          f"({len(paths)} windows, {total_calls} calls); top by own time:")
    print(f"  {'own µs/call':>11} {'cum µs/call':>11} {'calls/call':>10}  function")
    for tottime, cumtime, ncalls, where in rows[:top]:
        print(f"  {tottime * 1e6 / total_calls:11.1f} {cumtime * 1e6 / total_calls:11.1f} "
              f"{ncalls / total_calls:10.2f}  {where}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == _PROFILED:
        _profiled_gateway(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=300, help="calls per window")
    p.add_argument("--warmup", type=int, default=100, help="calls per (front, model) before the windows")
    p.add_argument("--in-flight", type=lambda text: [int(n) for n in text.split(",")], default=[1, 8],
                   help="calls in flight, comma-separated: a window for each")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-cpu", action="store_true", help="no CPU-time run outside valgrind")
    p.add_argument("--skip-callgrind", action="store_true")
    p.add_argument("--profile", action="store_true", help="also a cProfile run: top Python functions")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--threads", action="store_true",
                   help="count each thread of the gateway apart (callgrind --separate-threads)")
    p.add_argument("--keep", type=Path, help="copy each window's callgrind dump into this folder")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, \
            RedisServer(Path(tmp) / "redis", appendonly=False) as redis:
        worker = subprocess.Popen([sys.executable, "-m", "asyncinfer", "worker", "--device", "cpu",
                                   "--models", ",".join(MODELS), "--hostname", "gateway-ir@%h"],
                                  env=_env(redis.url), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            for model in MODELS:
                wait_hosted(redis.url, model, worker)
            runs = []
            if not args.skip_callgrind:
                out = str(Path(tmp) / "callgrind.out")
                threads = ["--separate-threads=yes"] if args.threads else []
                runs.append(("callgrind", ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                           *threads, f"--callgrind-out-file={out}",
                                           sys.executable], out))
            if not args.skip_cpu:
                runs.append(("cpu", [sys.executable], ""))
            if args.profile:
                os.environ["GATEWAY_PROFILE_OUT"] = str(Path(tmp) / "profile")
                runs.append(("profile", [sys.executable, os.path.abspath(__file__), _PROFILED], ""))
            for kind, prefix, out in runs:
                print(f"{kind}: gateway {' '.join(prefix[:2])} ..., {args.calls} calls a window, "
                      f"{args.in_flight} in flight", flush=True)
                process, grpc_port, http_port = _gateway(redis.url, prefix, Path(tmp) / f"{kind}.log")
                try:
                    figures = asyncio.run(_windows(args, process, grpc_port, http_port, kind, out))
                finally:
                    if process.poll() is not None:
                        print(f"the gateway ended: {(Path(tmp) / f'{kind}.log').read_text()[-3000:]}")
                    stop_process(process, signal.SIGTERM, 60)
                if kind == "profile":
                    if args.keep is not None:
                        args.keep.mkdir(parents=True, exist_ok=True)
                        for path in glob.glob(os.environ["GATEWAY_PROFILE_OUT"] + ".[0-9]*"):
                            shutil.copy(path, args.keep)
                    _print_profile(os.environ["GATEWAY_PROFILE_OUT"], args.calls, args.top)
                else:
                    unit = "Ir" if kind == "callgrind" else "CPU ms"
                    for (front, model, in_flight), values in figures.items():
                        spread = (max(values) - min(values)) / max(values) * 100 if max(values) else 0.0
                        shown = ", ".join(f"{v:,.0f}" if kind == "callgrind" else f"{v:.3f}" for v in values)
                        print(f"{kind} {front:4} {model:8} {in_flight:3} in flight: {unit} per call "
                              f"{shown} (spread {spread:.2f} %)", flush=True)
        finally:
            stop_process(worker, signal.SIGTERM, 30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
