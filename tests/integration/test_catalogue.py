"""The model catalogue: what live workers announce, what lapses, and what a submit is refused for."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from asyncinfer.broker.catalogue import Catalogue
from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.errors import UnknownModel
from tests.support.processes import ROOT, start_worker, worker_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)


def test_announce_lapse_withdraw_and_forget(redis_db) -> None:
    catalogue = Catalogue(redis_db.client, ttl_s=0.6, retention_s=2.0)
    catalogue.announce("w1@h", [{"name": "mlp", "versions": ["1"]}], device="cuda:0", pid=11)
    catalogue.announce("w2@h", [{"name": "mlp", "versions": ["1"]}, {"name": "identity"}],
                       device="cpu", pid=12)
    entries = catalogue.read()
    assert list(entries) == ["identity", "mlp"]
    assert [(h.worker, h.device, h.pid) for h in entries["mlp"].hosts] == [
        ("w1@h", "cuda:0", 11), ("w2@h", "cpu", 12)]
    # a withdrawal leaves the model known, with the other worker
    catalogue.withdraw("w1@h", ["mlp"])
    assert [h.worker for h in catalogue.read()["mlp"].hosts] == ["w2@h"]
    # past the TTL nobody hosts it, yet it is known (a scale-from-zero queue still takes requests)
    time.sleep(0.8)
    entries = catalogue.read()
    assert not entries["mlp"].ready and not entries["identity"].ready
    # past the retention window it is forgotten; every key the catalogue writes has a TTL
    time.sleep(1.5)
    assert catalogue.read() == {}
    catalogue.announce("w3@h", [{"name": "affine"}])
    assert list(catalogue.read()) == ["affine"]
    keys = list(redis_db.client.scan_iter(match="asyncinfer:models:*"))
    assert keys and all(redis_db.client.ttl(k) > 0 for k in keys)


def test_live_workers_show_and_a_killed_ones_lapse(redis_db, tmp_path) -> None:
    # Given two workers with a short catalogue TTL
    env = {"ASYNCINFER_CATALOGUE_TTL_S": "1.5"}
    kept = start_worker(redis_db.url, tmp_path / "a.log", "--device", "cpu", "--models", "identity",
                        "--hostname", "kept@%h", **env)
    killed = start_worker(redis_db.url, tmp_path / "b.log", "--device", "cpu", "--models",
                          "identity,mlp", "--hostname", "killed@%h", **env)
    client = Client(settings=Settings.from_env(environ={"ASYNCINFER_BROKER_URL": redis_db.url}))
    try:
        entries = wait_for(lambda: (e := client.models()) and len(e.get("identity", None).hosts
                                                                 if "identity" in e else []) == 2 and e,
                           30, "both workers announced")
        assert [h.worker.split("@")[0] for h in entries["identity"].hosts] == ["kept", "killed"]
        assert entries["mlp"].metadata["inputs"] == [{"name": "input", "datatype": "FP32",
                                                      "shape": [-1, 16]}]
        assert entries["mlp"].hosts[0].device == "cpu" and entries["mlp"].hosts[0].pid == killed.pid
        # and `asyncinfer models --json` says the same
        out = subprocess.run([sys.executable, "-m", "asyncinfer", "models", "--json"], cwd=ROOT,
                             env=worker_env(redis_db.url), capture_output=True, text=True, timeout=60)
        listed = json.loads(out.stdout)
        assert listed["mlp"]["ready"] is True and listed["mlp"]["max_batch_size"] == 32
        assert [w["worker"].split("@")[0] for w in listed["mlp"]["workers"]] == ["killed"]

        # When one is killed outright, Then its models lapse after the TTL, and stay known
        killed.process.send_signal(signal.SIGKILL)
        killed.process.wait()
        entries = wait_for(lambda: (e := client.models()) and not e["mlp"].ready and e, 10,
                           "the killed worker's entry lapsed")
        assert [h.worker.split("@")[0] for h in entries["identity"].hosts] == ["kept"]
        future = client.submit("mlp", np.zeros((1, 16), np.float32))  # queued, not refused
        future.sent()
        assert redis_db.client.llen("infer.mlp") == 1
        future.cancel()
        # And a worker that stops withdraws its entry at once
        kept.stop()
        assert not client.models()["identity"].ready
    finally:
        client.close()
        kept.stop()
        killed.stop()


def test_a_model_never_announced_is_refused_at_submit(redis_db) -> None:
    Catalogue(redis_db.client).announce("w@h", [{"name": "mlp"}, {"name": "identity"}])
    client = Client(settings=Settings.from_env(environ={"ASYNCINFER_BROKER_URL": redis_db.url}))
    try:
        with pytest.raises(UnknownModel) as caught:
            client.submit("nosuchmodel", np.zeros((1, 1), np.float32), request_id="typo-1")
        message = str(caught.value)
        # Triton's words first (its clients match on them), then the request and why
        assert message.startswith("Request for unknown model: 'nosuchmodel' is not found (request "
                                  "typo-1): no worker announced it in the last 24 h")
        assert "known: identity, mlp" in message and "--models nosuchmodel" in message
        assert not redis_db.client.exists("infer.nosuchmodel")
        assert "typo-1" not in client.watcher._callbacks  # nothing left waiting
        # A model announced a moment ago is taken at once (the known set is read again)
        Catalogue(redis_db.client).announce("w@h", [{"name": "fresh"}])
        client.submit("fresh", np.zeros((1, 1), np.float32)).sent().cancel()
        assert redis_db.client.llen("infer.fresh") == 1
    finally:
        client.close()


def test_nothing_is_refused_before_any_announcement_or_with_retention_zero(redis_db) -> None:
    for environ in ({}, {"ASYNCINFER_MODEL_RETENTION_S": "0"}):
        client = Client(settings=Settings.from_env(
            environ={"ASYNCINFER_BROKER_URL": redis_db.url, **environ}))
        try:
            if environ:
                Catalogue(redis_db.client).announce("w@h", [{"name": "mlp"}])
            client.submit("later", np.zeros((1, 1), np.float32)).sent().cancel()
        finally:
            client.close()
    assert redis_db.client.llen("infer.later") == 2


def test_cli_infer_of_an_unknown_model_says_so_at_once(redis_url, worker) -> None:
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "asyncinfer", "infer", "nosuchmodel", "--input", "-"],
                         input="[[1.0]]", cwd=ROOT, env=worker_env(redis_url), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1
    assert time.monotonic() - started < 30  # it used to wait the whole 60 s timeout
    assert "UnknownModel" in out.stderr
    assert "Request for unknown model: 'nosuchmodel' is not found" in out.stderr
    assert "identity" in out.stderr and "mlp" in out.stderr
