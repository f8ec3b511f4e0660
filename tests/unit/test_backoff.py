"""The one backoff every retrying loop uses."""

from __future__ import annotations

import pytest

from asyncinfer.backoff import Backoff

pytestmark = pytest.mark.timeout(30)


def test_waits_double_from_the_first_to_the_most_and_a_success_starts_again() -> None:
    backoff = Backoff()
    assert [backoff.failed() for _ in range(8)] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert backoff.waiting
    backoff.reset()
    assert not backoff.waiting and backoff.failed() == 0.1
    slow = Backoff(0.5, 2.0)
    assert [slow.failed() for _ in range(4)] == [0.5, 1.0, 2.0, 2.0]
