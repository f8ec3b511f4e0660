"""A worker is in the model catalogue before it answers anything (worker/bootstrap.py,
worker/announcer.py, worker/step.py), on either consumer.

On a fresh database a request is queued before the worker starts, so the worker takes it the
moment it may take anything; the catalogue is read at the moment the answer arrives (in the
result watcher's thread, which settles the future). Before the fix the answer came ~1.5 s after
start and the entry 1.5-4.5 s later: this read found no worker.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import redis

from asyncinfer.broker.catalogue import Catalogue, CatalogueEntry
from asyncinfer.client import Client
from tests.support.databases import RedisDatabase
from tests.support.processes import launch_worker
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("consumer", ["fast", "celery"])
def test_a_workers_first_answer_finds_its_model_in_the_catalogue(
        redis_db: RedisDatabase, tmp_path: Path, consumer: str) -> None:
    # Given a fresh database (no catalogue at all) and a request queued before any worker runs
    assert redis_db.client.dbsize() == 0
    client = Client(broker_url=redis_db.url)
    catalogue = Catalogue(redis.Redis.from_url(redis_db.url))
    at_answer: list[dict[str, CatalogueEntry]] = []
    read = threading.Event()

    def read_catalogue(_: object) -> None:
        at_answer.append(catalogue.read())
        read.set()

    worker = None
    try:
        future = client.submit("identity", np.ones((1, 2), np.float32))
        future.add_done_callback(read_catalogue)
        # When a worker starts and answers it
        worker = launch_worker(redis_db.url, tmp_path / "worker.log", "--device", "cpu",
                               "--models", "identity", "--hostname", "first@%h",
                               ASYNCINFER_CONSUMER=consumer)
        response = future.result(timeout=180)
        assert response.id == future.id
        wait_for(read.is_set, 10, "the catalogue read at the answer")
        # Then the catalogue already had the model, live on that worker, when the answer came
        entry = at_answer[0].get("identity")
        assert entry is not None, f"catalogue empty at the first answer: {at_answer[0]}"
        assert entry.ready and [h.worker.split("@")[0] for h in entry.hosts] == ["first"]
    finally:
        client.close()
        catalogue.client.close()
        if worker is not None:
            worker.stop()
