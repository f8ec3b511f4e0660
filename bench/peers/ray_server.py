"""Ray Serve serving a bench workload: ``python bench/peers/ray_server.py --workload minilm
--port P`` (in the peers venv; P is the HTTP port of Ray Serve's proxy).

One replica per model instance (the model's ``instances``); ``@serve.batch`` gets the model's
own max batch and delay (32 rows, 5 ms for minilm and the sim models); ``max_ongoing_requests``
is raised above the bench's in-flight levels, so that Ray Serve's default (5) does not cap the
batches. ``POST /`` with ``{"row": ...}`` (one row:
a string, or a list of numbers) answers ``{"output": [...], "batch_size": n}``. Prints ``READY``
once it serves; stops on SIGTERM.

Ray ships the deployment and each request between its own processes with its own pickling: that
is the peer's internals, in the peers venv. The bench's load reaches it as JSON over HTTP, and no
asyncinfer message is ever pickled.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

import numpy as np

#: Above the bench's largest in-flight level (256).
MAX_ONGOING_REQUESTS = 1024


def build_app(workload: str) -> Any:
    from ray import serve
    from served import ServedModel, model_options  # this folder is on sys.path (and the replicas')

    options = model_options(workload)  # read without loading: the replica loads the model

    @serve.deployment(num_replicas=options.instances, max_ongoing_requests=MAX_ONGOING_REQUESTS,
                      ray_actor_options={"num_cpus": 0})
    class Peer:
        def __init__(self, workload_name: str) -> None:
            self.served = ServedModel(workload_name)

        @serve.batch(max_batch_size=options.max_batch_size,
                     batch_wait_timeout_s=options.max_delay_ms / 1000.0)
        async def handle_batch(self, rows: list[Any]) -> list[dict[str, Any]]:
            if self.served.datatype == "BYTES":
                batch = np.array([r.encode() for r in rows], dtype=object)
            else:
                batch = np.asarray(rows, dtype=np.float32)
            out = self.served(batch)
            return [{"output": row.tolist(), "batch_size": len(rows)} for row in out]

        async def __call__(self, request: Any) -> dict[str, Any]:
            body = await request.json()
            return await self.handle_batch(body["row"])

    return Peer.bind(workload)  # type: ignore[attr-defined]  # serve.deployment adds it


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", required=True)
    p.add_argument("--port", type=int, required=True, help="HTTP")
    args = p.parse_args()

    import ray
    from ray import serve

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    stop = threading.Event()  # handlers set after ray.init, which sets its own
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(args.workload), name="peer", route_prefix="/", blocking=False)
        print("READY", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
