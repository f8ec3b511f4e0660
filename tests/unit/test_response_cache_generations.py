"""The response cache's generations (worker/cache_generations.py, broker/response_cache.py), in
process on fakeredis: an entry's key names the weights that computed it, the look-up reads the
weights answering now, a write of other weights is not kept, and a runtime's loads, unloads and
reloads record which weights answer. With real Redis and workers:
tests/integration/test_response_cache_generations.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import torch

from asyncinfer.broker import response_cache
from asyncinfer.broker.publisher import _PUBLISH, CACHED, PUBLISHED, Publisher, script_arguments
from asyncinfer.config.settings import Settings
from asyncinfer.wire.cache_key import cache_key, entry_key, generation_key, generation_name, split_entry
from asyncinfer.wire.keys import response_cache_generation_key, response_cache_stats_key
from asyncinfer.worker.cache_generations import CacheGenerations
from asyncinfer.worker.runtime import WorkerRuntime

pytestmark = pytest.mark.timeout(60)

OPTIONS = json.dumps({"scale": {"response_cache": True}, "mlp": {"response_cache": True}})


def _kwargs(version: Any = None) -> dict[str, Any]:
    request: dict[str, Any] = {"model": "scale", "inputs": [
        {"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.5]}]}
    if version is not None:
        request["parameters"] = {"model_version": version}
    return request


# -- the key ------------------------------------------------------------------------------------

def test_the_stem_names_the_generation_and_the_entry_the_weights() -> None:
    stem = cache_key("scale", _kwargs())
    assert stem is not None and stem.startswith("asyncinfer:cache:entry:scale:")
    assert generation_key(stem) == response_cache_generation_key("scale")
    versioned = cache_key("scale", _kwargs(2))
    assert versioned is not None and versioned.startswith("asyncinfer:cache:entry:scale@2:")
    assert generation_key(versioned) == response_cache_generation_key("scale@2")
    # the version is read as the worker routes by it: "2" and 2 alike, a bool names none
    assert generation_name("scale", _kwargs("2")) == generation_name("scale", _kwargs(2)) == "scale@2"
    assert generation_name("scale", _kwargs(True)) == generation_name("scale", _kwargs("")) == "scale"
    assert split_entry(entry_key(versioned, "ab12")) == (generation_key(versioned), "ab12")
    assert generation_key("not a cache key") == ""


# -- the scripts --------------------------------------------------------------------------------

@pytest.fixture()
def client() -> fakeredis.FakeRedis:
    return fakeredis.FakeRedis()


def _write(client: fakeredis.FakeRedis, key: str, answer: str) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    stored = response_cache.template(json.dumps({"status": "SUCCESS", "result": answer,
                                                 "task_id": response_cache.MARK}))
    response_cache.write(pipe, "scale", [(key, stored)], ttl_s=60, max_entries=10)
    [reply] = pipe.execute()
    return list(reply)


def _publish(client: fakeredis.FakeRedis, stem: str, request_id: str) -> int:
    publisher = Publisher(client, claim_ttl_s=60)
    push = publisher.prepare("infer.scale", request_id, "message", claim=False,
                             result_key=f"celery-task-meta-{request_id}", cache_key=stem)
    keys, args = script_arguments([push])
    reply = client.eval(_PUBLISH, len(keys), *keys, *args)
    return int(reply[0])


def test_an_entry_is_found_only_while_its_weights_answer(client: fakeredis.FakeRedis) -> None:
    stem = cache_key("scale", _kwargs())
    assert stem is not None
    # Given no weights recorded: nothing is written, nothing found
    assert _write(client, entry_key(stem, "w1"), "one") == [0, 1]
    assert _publish(client, stem, "r0") == PUBLISHED
    # When w1 answers, its answer is kept and found
    response_cache.record_generations(client, {"scale": "w1"}, {})
    assert _write(client, entry_key(stem, "w1"), "one") == [0, 0]
    assert _publish(client, stem, "r1") == CACHED
    assert json.loads(client.get("celery-task-meta-r1"))["result"] == "one"
    # Then once w2 answers (a load), w1's answer is not found, and a late write of w1 is not kept
    response_cache.record_generations(client, {"scale": "w2"}, {})
    assert _publish(client, stem, "r2") == PUBLISHED
    assert _write(client, entry_key(stem, "w1"), "late") == [0, 1]
    assert _publish(client, stem, "r3") == PUBLISHED
    stats = client.hgetall(response_cache_stats_key("scale"))
    assert (int(stats[b"hits"]), int(stats[b"misses"])) == (1, 3)
    # and when w1 answers again (the same file loaded again), its entry is found again
    response_cache.record_generations(client, {"scale": "w1"}, {})
    assert _publish(client, stem, "r4") == CACHED


def test_a_removal_leaves_another_workers_weights(client: fakeredis.FakeRedis) -> None:
    response_cache.record_generations(client, {"scale": "mine", "scale@1": "mine"}, {})
    response_cache.record_generations(client, {"scale": "theirs"}, {})  # a later load elsewhere
    assert response_cache.record_generations(client, {}, {"scale": "mine", "scale@1": "mine"}) == 1
    assert client.get(response_cache_generation_key("scale")) == b"theirs"
    assert client.get(response_cache_generation_key("scale@1")) is None


# -- the worker's generations ---------------------------------------------------------------------

def _generations(client: fakeredis.FakeRedis) -> CacheGenerations:
    settings = dataclasses.replace(Settings.from_env(device="cpu"), model_options=OPTIONS)
    return CacheGenerations(settings, lambda: [client])


def test_a_request_taken_before_a_change_of_routes_gets_no_token(client: fakeredis.FakeRedis) -> None:
    generations = _generations(client)
    with generations.changing({"scale": "w1"}):
        assert client.get(response_cache_generation_key("scale")) == b"w1"  # before the routes
    taken = time.perf_counter()
    assert generations.entry_token("scale", taken) == "w1"
    assert generations.entry_token("scale@1", taken) == ""
    with generations.changing({"scale": "w2"}):
        assert generations.entry_token("scale", time.perf_counter()) == ""  # under way
    # taken before the change: it may have been routed the old way
    assert generations.entry_token("scale", taken) == ""
    assert generations.entry_token("scale", time.perf_counter()) == "w2"


def test_a_generation_refused_by_redis_is_recorded_again(client: fakeredis.FakeRedis,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import redis

    from asyncinfer.worker import cache_generations

    monkeypatch.setattr(cache_generations, "RETRY_S", 0.01)
    calls = []
    real = response_cache.record_generations

    def record(c: Any, set_tokens: dict[str, str], removed: dict[str, str]) -> int:
        calls.append(dict(set_tokens))
        if len(calls) == 1:
            raise redis.ConnectionError("down")
        return real(c, set_tokens, removed)

    monkeypatch.setattr(cache_generations.response_cache, "record_generations", record)
    generations = _generations(client)
    with generations.changing({"scale": "w1"}):
        pass
    deadline = time.monotonic() + 10
    while client.get(response_cache_generation_key("scale")) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.get(response_cache_generation_key("scale")) == b"w1"
    assert calls == [{"scale": "w1"}, {"scale": "w1"}]


# -- the runtime's loads, unloads and reloads -----------------------------------------------------

class _Scale(torch.nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = torch.nn.Parameter(torch.tensor(k), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


def _save(path: Path, k: float) -> str:
    torch.jit.script(_Scale(k)).save(str(path))
    return hashlib.sha256(path.read_bytes()).hexdigest()[:32]


def _runtime(tmp_path: Path, client: fakeredis.FakeRedis, models: tuple[str, ...]) -> WorkerRuntime:
    settings = dataclasses.replace(Settings.from_env(device="cpu"), models=models, metrics_port=0,
                                   model_dir=str(tmp_path), model_options=OPTIONS)
    runtime = WorkerRuntime(settings, cache_generations=CacheGenerations(settings, lambda: [client]))
    runtime.load(models)
    return runtime


def _recorded(client: fakeredis.FakeRedis) -> dict[str, str]:
    prefix = response_cache_generation_key("")
    return {k.decode()[len(prefix):]: client.get(k).decode()
            for k in client.scan_iter(match=prefix + "*")}


def test_loads_unloads_and_reloads_record_the_weights_that_answer(
        tmp_path: Path, client: fakeredis.FakeRedis) -> None:
    one = _save(tmp_path / "scale.pt", 2.0)
    runtime = _runtime(tmp_path, client, ("scale", "identity"))
    try:
        # a file model's weights: its content's hash; a model without the cache: nothing
        assert _recorded(client) == {"scale": one, "scale@1": one}
        # version 2 loads beside it: requests naming none are answered by version 2
        two = _save(tmp_path / "scale@2.pt", 5.0)
        assert runtime.load_one("scale@2")
        assert _recorded(client) == {"scale": two, "scale@1": one, "scale@2": two}
        # version 2 unloaded: version 1 answers again
        runtime.unhost("scale@2")
        runtime.unload("scale@2")
        assert _recorded(client) == {"scale": one, "scale@1": one}
        # reloaded with other weights: the new ones answer (the old entries are never read)
        runtime.unhost("scale")
        runtime.unload("scale")
        assert _recorded(client) == {}
        three = _save(tmp_path / "scale.pt", 3.0)
        assert runtime.load_one("scale")
        assert _recorded(client) == {"scale": three, "scale@1": three}
        # and a request taken now is given the token of what runs it
        request, future = runtime.submit("r1", _kwargs(), received_at=time.perf_counter())
        assert future.result(timeout=30).outputs[0].value.tolist() == [[4.5]]
        generations = runtime.cache_generations
        assert generations is not None
        assert generations.entry_token("scale", time.perf_counter()) == three
    finally:
        runtime.close()


def test_built_in_weights_are_the_same_in_every_runtime_and_a_factorys_its_own(
        tmp_path: Path, client: fakeredis.FakeRedis) -> None:
    first = _runtime(tmp_path, client, ("mlp",))
    mlp = _recorded(client)["mlp"]
    second = _runtime(tmp_path, fakeredis.FakeRedis(), ("mlp",))
    try:
        generations = second.cache_generations
        assert generations is not None
        assert generations.entry_token("mlp", time.perf_counter()) == mlp
        # a model the worker cannot fingerprint gets a new token at each load
        from asyncinfer.models.base import Model

        class Made(Model):
            pass

        assert generations.token(Made(), None) != generations.token(Made(), None)
    finally:
        first.close()
        second.close()
