"""Which gRPC server for the gateway: ``grpc.aio`` vs the synchronous ``grpc.server`` on a thread
pool, each answering a raw-bytes echo in its own process, with or without the gateway's wait.

    .venv/bin/python bench/grpc_servers.py [--servers aio,sync16,aio-wait,sync256-wait] \\
        [--in-flight 256] [--duration-s 4] [--rounds 2]

``aio`` and ``syncN`` (N threads) answer at once. The ``-wait`` forms answer as the gateway does:
each call waits for a result that another thread settles in bursts every 1 ms (the result
watcher's part) — on the loop, one ``call_soon_threadsafe`` per burst ends every waiting call
(gateway/handover.py's way); on the thread pool, each call blocks its thread on a
``concurrent.futures.Future``. A closed loop of ``grpc.aio`` calls from this process keeps
``--in-flight`` calls going; it prints calls/s and the server's CPU milliseconds per call (from
``/proc``). Compare only the lines of one run: this host is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import grpc

SERVICE, METHOD = "bench.Echo", "Echo"
PAYLOAD = b"x" * 300


def _bytes(value: bytes) -> bytes:
    return value


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Settler:
    """Settles what is handed to it in bursts every 1 ms, from its own thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._waiting: list[tuple[Any, bytes]] = []
        threading.Thread(target=self._run, daemon=True).start()

    def put(self, future: Any, value: bytes) -> None:
        with self._lock:
            self._waiting.append((future, value))

    def _run(self) -> None:
        while True:
            time.sleep(0.001)
            with self._lock:
                burst, self._waiting = self._waiting, []
            if not burst:
                continue
            if self.loop is not None:
                self.loop.call_soon_threadsafe(_settle, burst)
            else:
                _settle(burst)


def _settle(burst: list[tuple[Any, bytes]]) -> None:
    for future, value in burst:
        future.set_result(value)


def _handler(echo: Any) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        METHOD: grpc.unary_unary_rpc_method_handler(echo, _bytes, _bytes)})


def _serve(kind: str, port: int) -> None:
    wait = kind.endswith("-wait")
    kind = kind.removesuffix("-wait")
    if kind == "aio":
        async def main() -> None:
            loop = asyncio.get_running_loop()
            settler = _Settler(loop)

            async def echo(request: bytes, context: Any) -> bytes:
                if not wait:
                    return request
                future = loop.create_future()
                settler.put(future, request)
                return await future

            server = grpc.aio.server()
            server.add_generic_rpc_handlers((_handler(echo),))
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            print("ready", flush=True)
            await server.wait_for_termination()

        asyncio.run(main())
        return
    threads = int(kind.removeprefix("sync"))
    settler = _Settler(None)

    def echo(request: bytes, context: Any) -> bytes:
        if not wait:
            return request
        future: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        settler.put(future, request)
        return future.result()

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(threads))
    server.add_generic_rpc_handlers((_handler(echo),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


async def _load(port: int, pid: int, in_flight: int, duration_s: float) -> tuple[int, float, float]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary(f"/{SERVICE}/{METHOD}", request_serializer=_bytes,
                               response_deserializer=_bytes)
    for _ in range(50):
        await call(PAYLOAD)
    done = 0
    stop = time.monotonic() + duration_s

    async def one_slot() -> None:
        nonlocal done
        while time.monotonic() < stop:
            await call(PAYLOAD)
            done += 1

    cpu0, t0 = _cpu_s(pid), time.monotonic()
    await asyncio.gather(*(one_slot() for _ in range(in_flight)))
    elapsed_s, cpu_s = time.monotonic() - t0, _cpu_s(pid) - cpu0
    await channel.close()
    return done, elapsed_s, cpu_s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--servers", default="aio,sync16,aio-wait,sync256-wait,sync64-wait")
    p.add_argument("--in-flight", type=int, default=256)
    p.add_argument("--duration-s", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        _serve(args.serve, args.port)
        return 0
    for _ in range(args.rounds):
        for kind in args.servers.split(","):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            server = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)],
                                      stdout=subprocess.PIPE)
            try:
                assert server.stdout is not None
                server.stdout.readline()
                done, elapsed_s, cpu_s = asyncio.run(
                    _load(port, server.pid, args.in_flight, args.duration_s))
                print(f"{kind:14s} {done / elapsed_s:7.0f} calls/s  server CPU "
                      f"{cpu_s * 1000 / max(1, done):.3f} ms/call", flush=True)
            finally:
                server.terminate()
                server.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
