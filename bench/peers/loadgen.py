"""The peers' closed-loop load generator (runs in the peers venv): ``python bench/peers/loadgen.py
--target triton --port P --workload minilm --in-flight 1,256 --duration-s 8 --server-pid PID``.

The bench's own generator (``asyncinfer.ops.benchmark.v2_loadgen``: its closed loop, its lines, the same
requests the bench sends asyncinfer) with the peers as targets: Triton through its gRPC aio
client, Ray Serve through HTTP to its proxy. ``asyncinfer bench --systems triton,ray`` runs it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from asyncinfer.ops.benchmark.v2_loadgen import CONNECTORS, Call, Connect, grpc_connector, main, request_rows


async def _triton(port: int, workload: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    # PyTriton's BYTES input is [n, 1]; the batch size comes back as an output of its own
    return await grpc_connector(port, workload, rows_as_columns=True,
                                batch_size=lambda r: int(r.as_numpy("batch_size").reshape(-1)[0]))


async def _ray(port: int, workload: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    import aiohttp

    _, datatype, rows = request_rows(workload)
    bodies = [json.dumps({"row": r[0].decode() if datatype == "BYTES" else r[0].tolist()}) for r in rows]
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    headers={"Content-Type": "application/json"})
    url = f"http://127.0.0.1:{port}/"

    async def call(i: int) -> int:
        async with session.post(url, data=bodies[i % len(bodies)]) as response:
            response.raise_for_status()
            return int((await response.json())["batch_size"])

    return call, session.close


#: What ``--target`` takes: the peers, and the asyncinfer gateway's fronts.
PEER_CONNECTORS: dict[str, Connect] = {"triton": _triton, "ray": _ray, **CONNECTORS}

if __name__ == "__main__":
    main(connectors=PEER_CONNECTORS)
