"""How many threads torch's intra-op pool (``torch.set_num_threads``) gets in a CPU worker.

torch gives one operator every core by default. A CPU worker that runs ``instances`` batches at
once, each on its own device thread, then asks for ``instances × cores`` threads: every operator
waits at its barrier for the slowest of them, and a core taken by a serving thread for a moment
stalls the whole operator. One pool share per instance keeps each core busy with one batch
(measured, MiniLM on 2 cores: 1.3× the sentences/s of one instance on two threads, in-process and
served, with the same latency at one request in flight; bench/results/HISTORY.md, "What moved
minilm from 0.49 to 0.64–0.69 of its limit").

``ASYNCINFER_INTRA_OP_THREADS`` (``asyncinfer worker --intra-op-threads``) sets the number; 0,
the default, means cores // instances on a CPU device unless ``OMP_NUM_THREADS`` is set, and
torch's own choice on an accelerator (whose host side needs few threads).
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["cpu_cores", "intra_op_threads", "apply_intra_op_threads"]

log = logging.getLogger(__name__)


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers and ``taskset``
    narrow), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def intra_op_threads(configured: int, instances: int, *, on_cpu: bool, cores: int,
                     omp_num_threads: str | None) -> int | None:
    """The intra-op thread count to set, or None to leave torch's own.

    ``configured`` > 0 always wins. Otherwise, on a CPU device with no ``OMP_NUM_THREADS``:
    ``cores // instances``, at least 1 (``instances``: the most any hosted model runs at once).
    """
    if configured < 0:
        raise ValueError(f"intra-op threads must be >= 0 (0: automatic), got {configured}")
    if configured:
        return configured
    if not on_cpu or (omp_num_threads or "").strip():
        return None
    return max(1, cores // max(1, instances))


def apply_intra_op_threads(configured: int, instances: int, *, on_cpu: bool) -> int:
    """Set torch's intra-op pool as :func:`intra_op_threads` says; return the count in force."""
    threads = intra_op_threads(configured, instances, on_cpu=on_cpu, cores=cpu_cores(),
                               omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        log.info("torch intra-op threads: %d (%d instance(s) at once)", threads, instances)
    return int(torch.get_num_threads())
