"""What an operator sees, in process: the throughput ring behind ``asyncinfer status``. Metrics,
task events, status and log lines of real workers: tests/integration/test_observability.py."""

from __future__ import annotations

import pytest

from asyncinfer.worker.metrics import Ring

pytestmark = pytest.mark.timeout(180)


def test_throughput_ring_counts_the_last_seconds() -> None:
    ring = Ring(10)
    for second in range(100, 110):
        ring.add(5, now=second + 0.5)
    assert ring.rate(now=109.5) == pytest.approx(50 / 9.5)
    # Seconds older than the window drop out; a gap counts as zero
    assert ring.rate(now=115.0) == pytest.approx(20 / 9.0)
    assert ring.rate(now=130.0) == 0.0
