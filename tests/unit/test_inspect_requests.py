"""The worker banner a fast-consumer worker prints (worker/banner.py): its queues, its bound and
the true URLs. The worker itself under ``celery inspect`` and ``celery -A asyncinfer worker``:
tests/integration/test_inspect_requests.py."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_the_banner_names_the_fast_consumers_queues_bound_and_true_urls() -> None:
    from asyncinfer.worker.banner import truthful

    celery = ("- ** ---------- .> transport:   redis://:**@127.0.0.1:6379/0\n"
              "- ** ---------- .> results:     redis://127.0.0.1:6379/0\n"
              "- *** --- * --- .> concurrency: 2 (thread)\n"
              " -------------- [queues]\n"
              "                .> asyncinfer.control exchange=celery(direct) key=asyncinfer.control\n")
    assert truthful(celery, broker="redis://127.0.0.1:6379/0", results="redis://127.0.0.1:6379/0",
                    queues=["infer.mlp"], in_flight=128).splitlines() == [
        "- ** ---------- .> transport:   redis://127.0.0.1:6379/0",
        "- ** ---------- .> results:     redis://127.0.0.1:6379/0",
        "- *** --- * --- .> concurrency: 2 (thread); fast consumer: 128 requests in flight",
        " -------------- [queues]",
        "                .> infer.mlp (fast consumer)",
        "                .> asyncinfer.control exchange=celery(direct) key=asyncinfer.control"]
