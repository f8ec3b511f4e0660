"""A model's cached answers follow its weights (worker/cache_generations.py), with a real Redis and a
real worker process: a file model ``scale`` (TorchScript, ``x * k``) with the response cache on.
An answer cached under version 1 is not served once version 2 loads, nor once the model is
reloaded from a file whose weights changed: the request after the change runs on the device (its
answer is the new weights', it is no hit, and it counts as a miss)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncinfer.broker.response_cache import cache_stats
from asyncinfer.client import Client, InferResponse
from asyncinfer.config.settings import Settings
from tests.support.databases import RedisDatabase, RedisDatabases
from tests.support.processes import WorkerProcess, start_worker

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning")]

OPTIONS = json.dumps({"scale": {"response_cache": True}})
X = np.array([[1.5]], np.float32)


class _Scale(torch.nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = torch.nn.Parameter(torch.tensor(k), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


def _save(path: Path, k: float) -> None:
    torch.jit.script(_Scale(k)).save(str(path))


@pytest.fixture()
def served(redis_databases: RedisDatabases, tmp_path: Path
           ) -> Iterator[tuple[RedisDatabase, WorkerProcess, Client, Path]]:
    """A worker hosting ``scale`` (version 1: ×2) from a model folder, and a client; both with
    the cache on for it."""
    models = tmp_path / "models"
    models.mkdir()
    _save(models / "scale.pt", 2.0)
    with redis_databases.take("test_response_cache_generations") as db:
        proc = start_worker(db.url, tmp_path / "worker.log", "--device", "cpu", "--models", "scale",
                            ASYNCINFER_MODEL_DIR=str(models), ASYNCINFER_MODEL_OPTIONS=OPTIONS)
        client = Client(settings=Settings(broker_url=db.url, model_options=OPTIONS))
        try:
            yield db, proc, client, models
        finally:
            client.close()
            proc.stop()


def _infer(client: Client, version: int | None = None) -> InferResponse:
    return client.infer("scale", {"x": X}, timeout_s=60, version=version)


def _answer(response: InferResponse) -> float:
    return float(response["output"].reshape(-1)[0])


def _hit(response: InferResponse) -> bool:
    return response.raw["parameters"].get("cache_hit") is True


def _cached_under_version_1(db: RedisDatabase, client: Client) -> None:
    """Given version 1's answer computed, then served from the cache (1 miss, 1 hit)."""
    first, second = _infer(client), _infer(client)
    assert (_answer(first), _hit(first)) == (3.0, False)
    assert (_answer(second), _hit(second)) == (3.0, True)
    assert cache_stats(db.client, "scale")["hits"] == 1


def test_an_answer_cached_under_version_1_is_not_served_once_version_2_loads(served) -> None:
    db, _, client, models = served
    _cached_under_version_1(db, client)
    # When version 2 (×5) loads beside it
    _save(models / "scale@2.pt", 5.0)
    loaded = client.load_model("scale", version=2, timeout_s=120)
    assert loaded.ok, loaded.message()
    before = cache_stats(db.client, "scale")
    # Then the same request naming no version runs on version 2's weights: no hit, a miss counted
    after_load = _infer(client)
    assert (_answer(after_load), _hit(after_load)) == (7.5, False)
    assert after_load.raw["parameters"]["model_version"] == "2"
    after = cache_stats(db.client, "scale")
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (0, 1)
    # and it is cached in turn, as version 2's
    again = _infer(client)
    assert (_answer(again), _hit(again)) == (7.5, True)
    # A request naming version 1 still gets version 1's weights (from the device, then the cache)
    pinned = [_infer(client, version=1) for _ in range(2)]
    assert [(_answer(r), _hit(r)) for r in pinned] == [(3.0, False), (3.0, True)]
    # When version 2 is unloaded, version 1 answers again: never version 2's cached answer
    unloaded = client.unload_model("scale", version=2, timeout_s=120)
    assert unloaded.ok, unloaded.message()
    back = _infer(client)
    assert _answer(back) == 3.0  # version 1's weights (its own entry may serve it again)


def test_an_answer_cached_before_a_reload_with_new_weights_is_not_served(served) -> None:
    db, _, client, models = served
    _cached_under_version_1(db, client)
    # When the model is unloaded, its file replaced (×3), and loaded again
    unloaded = client.unload_model("scale", timeout_s=120)
    assert unloaded.ok, unloaded.message()
    _save(models / "scale.pt", 3.0)
    loaded = client.load_model("scale", timeout_s=120)
    assert loaded.ok, loaded.message()
    before = cache_stats(db.client, "scale")
    # Then the same request runs on the new weights: no hit, a miss counted
    after_reload = _infer(client)
    assert (_answer(after_reload), _hit(after_reload)) == (4.5, False)
    after = cache_stats(db.client, "scale")
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (0, 1)
    # and is cached in turn
    again = _infer(client)
    assert (_answer(again), _hit(again)) == (4.5, True)


def test_a_reload_of_the_same_weights_keeps_their_cached_answers(served) -> None:
    db, _, client, _ = served
    _cached_under_version_1(db, client)
    # When the model is unloaded and loaded again from the same file
    assert client.unload_model("scale", timeout_s=120).ok
    assert client.load_model("scale", timeout_s=120).ok
    # Then its answer cached before is still its weights' answer, and served
    again = _infer(client)
    assert (_answer(again), _hit(again)) == (3.0, True)
