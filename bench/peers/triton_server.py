"""Triton through PyTriton serving a bench workload: ``python bench/peers/triton_server.py
--workload minilm --port P [--http-port Q] [--metrics-port R]`` (in the peers venv; P is the gRPC
port the load generator drives, Q and R default to free ports).

Triton's dynamic batcher gets the model's own max batch and delay (32 rows, 5 ms for minilm and the
sim models), and its instance group the model's ``instances`` (KIND_CPU). The model's rows come
back with an INT32 ``batch_size`` output: the rows of the batch each request ran in, as asyncinfer
reports it. Prints ``READY`` once it serves; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sysconfig
import threading
from typing import Any

import numpy as np
from served import ServedModel  # this folder is on sys.path

from asyncinfer.ops.benchmark.host import free_port


def _same_libpython() -> None:
    """Make Triton's Python stub load this interpreter's libpython, not the system's: a stub that
    pairs another 3.11 patch release's libpython with this stdlib fails in multiprocessing."""
    libdir, name = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
    if libdir and name and os.path.exists(os.path.join(libdir, name)):
        old = os.environ.get("LD_LIBRARY_PATH")
        os.environ["LD_LIBRARY_PATH"] = libdir + (os.pathsep + old if old else "")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", required=True)
    p.add_argument("--port", type=int, required=True, help="gRPC")
    p.add_argument("--http-port", type=int, default=0, help="default: a free one")
    p.add_argument("--metrics-port", type=int, default=0, help="default: a free one")
    args = p.parse_args()

    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    _same_libpython()
    served = ServedModel(args.workload)

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        rows = inputs[served.input_name]
        out = served(rows)
        return {served.output_name: out,
                "batch_size": np.full((len(rows), 1), len(rows), dtype=np.int32)}

    in_dtype: Any = bytes if served.datatype == "BYTES" else np.float32
    in_shape = (1,) if served.datatype == "BYTES" else served.row_shape
    config = TritonConfig(grpc_port=args.port, http_port=args.http_port or free_port(),
                          metrics_port=args.metrics_port or free_port(), grpc_address="127.0.0.1",
                          http_address="127.0.0.1")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with Triton(config=config) as triton:
        triton.bind(
            model_name=served.name, infer_func=[infer] * served.instances,
            inputs=[Tensor(name=served.input_name, dtype=in_dtype, shape=in_shape)],
            outputs=[Tensor(name=served.output_name, dtype=np.float32, shape=served.output_row_shape),
                     Tensor(name="batch_size", dtype=np.int32, shape=(1,))],
            config=ModelConfig(max_batch_size=served.max_batch_size, batcher=DynamicBatcher(
                max_queue_delay_microseconds=int(served.max_delay_ms * 1000))),
            strict=False)
        triton.run()
        print("READY", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
