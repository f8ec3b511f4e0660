"""How much a consumer holds: a few device batches per instance, never more than its bound."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncinfer.worker.intake.holdings import held_at_most

pytestmark = [pytest.mark.timeout(30), pytest.mark.unit]


def _runner(max_batch_size: int, instances: int) -> SimpleNamespace:
    return SimpleNamespace(max_batch_size=max_batch_size,
                           options=SimpleNamespace(instances=instances))


def test_a_worker_holds_a_few_batches_per_instance_within_its_in_flight_bound() -> None:
    # one instance of batch 32: two batches, not the 128 that concurrency × prefetch allows
    assert held_at_most(128, 2, [_runner(32, 1)]) == 64
    # two models, two instances of one: summed
    assert held_at_most(512, 2, [_runner(32, 2), _runner(8, 1)]) == 2 * 32 * 2 + 2 * 8
    # never past the bound
    assert held_at_most(32, 2, [_runner(32, 2)]) == 32
    # a model that does not batch: two at a time
    assert held_at_most(128, 2, [_runner(1, 1)]) == 2
    # 0, or nothing loaded yet: the bound alone
    assert held_at_most(128, 0, [_runner(32, 1)]) == 128
    assert held_at_most(128, 2, []) == 128
