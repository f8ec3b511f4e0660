"""How many intra-op threads a worker gives torch (engine/threads.py): unit tier."""

from __future__ import annotations

import pytest

from asyncinfer.engine.threads import cpu_cores, intra_op_threads


@pytest.mark.parametrize(("configured", "instances", "on_cpu", "cores", "omp", "expected"), [
    (0, 1, True, 2, None, 2),      # one instance: every core, as torch itself would
    (0, 2, True, 2, None, 1),      # two instances on two cores: one thread each
    (0, 3, True, 16, None, 5),     # cores // instances
    (0, 4, True, 2, None, 1),      # never below one
    (0, 2, True, 8, "3", None),    # OMP_NUM_THREADS set: the user's choice stands
    (0, 2, True, 8, " ", 4),       # an empty OMP_NUM_THREADS is no choice
    (0, 2, False, 8, None, None),  # an accelerator: torch's own
    (3, 2, False, 8, None, 3),     # a configured count always wins
    (6, 2, True, 2, "1", 6),
])
def test_the_intra_op_threads_follow_cores_instances_and_the_users_choice(
        configured: int, instances: int, on_cpu: bool, cores: int, omp: str | None,
        expected: int | None) -> None:
    assert intra_op_threads(configured, instances, on_cpu=on_cpu, cores=cores,
                            omp_num_threads=omp) == expected


def test_a_negative_count_is_refused_with_the_rule() -> None:
    with pytest.raises(ValueError, match=r"intra-op threads must be >= 0 \(0: automatic\), got -1"):
        intra_op_threads(-1, 1, on_cpu=True, cores=2, omp_num_threads=None)


def test_the_cores_are_this_process_s_own() -> None:
    import os

    assert cpu_cores() == len(os.sched_getaffinity(0))
