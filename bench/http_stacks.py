"""Which async HTTP stack for the gateway's REST front: aiohttp (asyncio's loop or uvloop) vs
Starlette on uvicorn (httptools + uvloop), each serving a v2-shaped echo (read the JSON body, parse
it, answer JSON) in its own process.

    .venv/bin/pip install "uvicorn[standard]" starlette   # only for this comparison
    .venv/bin/python bench/http_stacks.py [--duration-s 5]

A closed loop (aiohttp client, its own process) keeps 1 and then 64 calls in flight; it prints
calls/s, p50 and p99, and the server's CPU milliseconds per call. The same machine, one sitting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

BODY = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                               "data": [0.5] * 16}]}).encode()


def _aiohttp_uvloop_server(port: int) -> None:
    import uvloop

    uvloop.install()
    _aiohttp_server(port)


def _aiohttp_server(port: int) -> None:
    from aiohttp import web

    async def infer(request: web.Request) -> web.Response:
        doc = json.loads(await request.read())
        return web.json_response({"model_name": "m", "outputs": doc["inputs"]})

    app = web.Application()
    app.add_routes([web.post("/v2/models/{m}/infer", infer)])
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def _starlette_server(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def infer(request: Request) -> Response:
        doc = json.loads(await request.body())
        return Response(json.dumps({"model_name": "m", "outputs": doc["inputs"]}),
                        media_type="application/json")

    app = Starlette(routes=[Route("/v2/models/{m}/infer", infer, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                loop="uvloop", http="httptools")


async def _drive(port: int, in_flight: int, duration_s: float) -> list[float]:
    import aiohttp

    url = f"http://127.0.0.1:{port}/v2/models/m/infer"
    latencies: list[float] = []
    stop = time.monotonic() + duration_s
    async with aiohttp.ClientSession() as session:
        async def one() -> None:
            while time.monotonic() < stop:
                t = time.perf_counter()
                async with session.post(url, data=BODY) as r:
                    await r.read()
                latencies.append(time.perf_counter() - t)
        await asyncio.gather(*(one() for _ in range(in_flight)))
    return latencies


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_SERVERS = {"aiohttp": _aiohttp_server, "aiohttp+uvloop": _aiohttp_uvloop_server,
            "starlette": _starlette_server}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--serve", choices=tuple(_SERVERS))
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.serve:
        _SERVERS[args.serve](args.port)
        return
    print(f"{'stack':15} {'in flight':>9} {'calls/s':>8} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'server CPU ms/call':>19}")
    for stack in _SERVERS:
        port = _free_port()
        server = subprocess.Popen([sys.executable, __file__, "--serve", stack, "--port", str(port)])
        try:
            for _ in range(100):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    time.sleep(0.1)
            asyncio.run(_drive(port, 4, 1.0))  # warm-up
            for in_flight in (1, 64):
                cpu = _cpu_s(server.pid)
                lat = asyncio.run(_drive(port, in_flight, args.duration_s))
                per_call_ms = (_cpu_s(server.pid) - cpu) / len(lat) * 1000
                lat.sort()
                print(f"{stack:15} {in_flight:>9} {len(lat) / args.duration_s:>8.0f} "
                      f"{statistics.median(lat) * 1000:>7.2f} {lat[int(len(lat) * 0.99)] * 1000:>7.2f} "
                      f"{per_call_ms:>19.3f}", flush=True)
        finally:
            server.terminate()
            server.wait(10)


if __name__ == "__main__":
    main()
