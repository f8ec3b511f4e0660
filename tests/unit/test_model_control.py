"""Model control's pure parts: the runtime's load and unload of one model, the broadcast's
targets and outcomes, the repository index, the gateway's load parameters."""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any

import numpy as np
import pytest

from asyncinfer.broker.catalogue import CatalogueEntry, Host
from asyncinfer.client.model_control import (
    LOAD,
    UNLOAD,
    ControlOutcome,
    control,
    outcomes_of,
    repository_index,
    targets_for,
)
from asyncinfer.config.settings import Settings
from asyncinfer.errors import UnknownModel
from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.gateway.model_control import control_options
from asyncinfer.models.base import Model
from asyncinfer.worker.runtime import LoadFailed, WorkerRuntime

pytestmark = pytest.mark.timeout(60)


class _Refused(Model):
    name = "refused"
    made: weakref.WeakSet[_Refused] = weakref.WeakSet()

    def __init__(self) -> None:
        _Refused.made.add(self)

    def load(self, device: Any) -> None:
        self.held = np.ones(1 << 20)  # allocated, then the load fails: freed with the runner
        raise RuntimeError("out of memory (simulated)")


def _runtime(tmp_path: Any, models: tuple[str, ...] = ("identity",)) -> WorkerRuntime:
    settings = dataclasses.replace(Settings.from_env(device="cpu"), models=models,
                                   metrics_port=0, model_dir=str(tmp_path))
    runtime = WorkerRuntime(settings)
    runtime.registry.register("refused", _Refused)
    runtime.load(models)
    return runtime


def _request(value: float) -> dict:
    return {"model": "mlp", "inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32",
                                        "data": [value] * 16}]}


def test_a_runtime_loads_and_unloads_one_model_and_hosts_what_it_says(tmp_path) -> None:
    runtime = _runtime(tmp_path)
    try:
        # not hosted before its load: refused, not loaded on first use
        with pytest.raises(UnknownModel, match="not hosted by this worker"):
            runtime.runner("mlp")
        assert runtime.load_one("mlp") is True and runtime.load_one("mlp") is False
        assert runtime.models == ["identity", "mlp"]
        assert runtime.infer("r1", _request(1.0), worker="w")["outputs"][0]["shape"] == [1, 4]
        # unhosted, then unloaded: refused again, not loaded again
        runtime.unhost("mlp")
        assert runtime.unload("mlp") is True and runtime.unload("mlp") is False
        assert runtime.models == ["identity"]
        with pytest.raises(UnknownModel, match=r"it hosts: identity\)"):
            runtime.runner("mlp")
        # the last model out: the worker hosts nothing, and loads nothing by itself
        runtime.unhost("identity")
        runtime.unload("identity")
        with pytest.raises(UnknownModel, match=r"it hosts: none"):
            runtime.runner("identity")
    finally:
        runtime.close()


def test_a_failed_load_says_why_and_changes_nothing(tmp_path) -> None:
    (tmp_path / "bad.pt").write_bytes(b"no TorchScript archive")
    runtime = _runtime(tmp_path)
    try:
        with pytest.raises(UnknownModel, match="'nosuch' is not registered"):
            runtime.load_one("nosuch")
        with pytest.raises(RuntimeError, match="out of memory") as failed:
            runtime.load_one("refused")
        assert not list(_Refused.made)  # freed, though the error (and its traceback) lives on
        assert failed.value.__traceback__ is not None
        with pytest.raises(ValueError, match=r"model 'bad': .*bad\.pt cannot be loaded: "
                                             r"PytorchStreamReader failed reading zip archive"):
            runtime.load_one("bad")
        assert runtime.models == ["identity"]
        with pytest.raises(UnknownModel, match="not hosted"):
            runtime.runner("refused")
        # a file added to the model folder since the runtime was made is found, and loadable
        assert "later" not in runtime.loadable()
        (tmp_path / "later.pt").write_bytes(b"")
        assert {"bad", "later", "identity", "mlp", "refused"} <= set(runtime.loadable())
    finally:
        runtime.close()


def test_a_start_load_leaves_out_an_optional_model_that_fails_and_refuses_a_required_one(
        tmp_path) -> None:
    # Given a model folder whose bad.pt is no archive
    (tmp_path / "bad.pt").write_bytes(b"no TorchScript archive")
    runtime = _runtime(tmp_path, models=())
    try:
        # When the start loads it among optional models, Then the others load, and it is refused
        # with its reason, the runtime serving on
        runtime.load(["identity", "bad", "refused"], optional=["bad", "refused"])
        assert runtime.models == ["identity"]
        assert list(runtime.failed) == ["bad", "refused"]
        assert runtime.failed["refused"] == "RuntimeError: out of memory (simulated)"
        assert not list(_Refused.made)  # what the failed load allocated is freed
        with pytest.raises(UnknownModel, match=r"request r1\): model 'bad' failed to load on this "
                                               r"worker: ValueError: model 'bad': .*bad\.pt "
                                               r"cannot be loaded"):
            runtime.runner("bad", "r1")
        # a required model's failure is raised, naming it
        with pytest.raises(LoadFailed, match=r"^loading refused failed: RuntimeError: out of "
                                             r"memory \(simulated\)$") as failed:
            runtime.load(["refused"])
        assert failed.value.model == "refused"
        # a model control load that succeeds clears the failure
        (tmp_path / "bad.pt").unlink()
        runtime.registry.register("bad", lambda: runtime.registry.create("identity"))
        assert runtime.load_one("bad") and "bad" not in runtime.failed
    finally:
        runtime.close()


def _entries() -> dict[str, CatalogueEntry]:
    return {"mlp": CatalogueEntry("mlp", {"name": "mlp", "versions": ["1"]},
                                  (Host("a@h"), Host("b@h"))),
            "gone": CatalogueEntry("gone", {"name": "gone"}, ())}


def test_targets_outcomes_and_messages() -> None:
    entries = _entries()
    assert targets_for(LOAD, "x", entries, ["c@h", "a@h"]) == ["a@h", "c@h"]
    assert targets_for(UNLOAD, "mlp", entries, ["c@h"]) == ["a@h", "b@h"]
    assert targets_for(UNLOAD, "gone", entries, ["c@h"]) == []
    found = outcomes_of([{"a@h": {"ok": True, "model": "mlp", "given_back": 2}},
                         {"b@h": {"ok": False, "error": "model 'mlp' is not loaded"}},
                         {"c@h": "garbage"}])
    assert found["a@h"].ok and not found["b@h"].ok and not found["c@h"].ok
    outcome = ControlOutcome("mlp", UNLOAD, (found["a@h"], found["b@h"]), missing=("d@h",))
    assert not outcome.ok
    assert outcome.message() == ("failed to unload 'mlp': unloaded on a@h; b@h: model 'mlp' "
                                 "is not loaded; no answer within the timeout from d@h (it may "
                                 "still be under way there)")
    assert ControlOutcome("mlp", LOAD, (found["a@h"],)).ok
    assert not ControlOutcome("mlp", LOAD, nobody="no live worker answered").ok


class _Control:
    """Celery's ``app.control`` as far as :func:`control` uses it: ``pongs`` answer a ping of
    every worker, a worker with a reply answers a ping naming it and its command, except while
    ``deaf`` counts its pings down (its control channel not subscribed yet: what is sent to it
    meanwhile is lost, as a PUBLISH nobody hears)."""

    def __init__(self, pongs: list[str], replies: dict[str, dict],
                 deaf: dict[str, int] | None = None) -> None:
        self.pongs, self.replies, self.sent = pongs, replies, []
        self.deaf = dict(deaf or {})
        self.pinged: list[list[str]] = []

    def ping(self, destination: list[str] | None = None, timeout: float = 1.0) -> list[dict]:
        if destination is None:
            return [{w: {"ok": "pong"}} for w in self.pongs]
        self.pinged.append(list(destination))
        heard = []
        for w in destination:
            if self.deaf.get(w, 0) > 0:
                self.deaf[w] -= 1
            elif w in self.replies:
                heard.append(w)
        if len(heard) < len(destination):
            time.sleep(timeout)  # a ping waits for those that do not answer
        return [{w: {"ok": "pong"}} for w in heard]

    def broadcast(self, command: str, **kwargs: Any) -> list[dict] | None:
        self.sent.append((command, kwargs))
        if not kwargs.get("reply"):
            return None
        return [{w: self.replies[w]} for w in kwargs["destination"] or self.replies
                if w in self.replies and not self.deaf.get(w)]


class _App:
    def __init__(self, control: _Control) -> None:
        self.control = control


def test_control_asks_every_live_worker_and_skips_those_that_run_no_model() -> None:
    replies = {"a@h": {"ok": True}, "c@h": {"ok": True},
               "cpu@h": {"ok": False, "error": "it is no device worker", "device_worker": False}}
    fake = _Control(["c@h", "cpu@h"], replies)
    outcome = control(_App(fake), LOAD, "x", _entries(), timeout_s=0.5)  # type: ignore[arg-type]
    # the catalogue's hosts that did not answer the fleet's ping are pinged by name first; the
    # command goes at once to those that listen (b@h never answers: it gets it, unawaited, at
    # the deadline)
    assert fake.pinged[0] == ["a@h", "b@h"] and all(p == ["b@h"] for p in fake.pinged[1:])
    command, sent = fake.sent[0]
    assert command == "asyncinfer_load_model" and sent["arguments"] == {"model": "x"}
    assert sent["destination"] == ["a@h", "c@h", "cpu@h"] and sent["limit"] == 3
    assert 0 < sent["timeout"] <= 0.5 and sent["reply"] is True
    assert fake.sent[-1] == ("asyncinfer_load_model", {"arguments": {"model": "x"},
                                                       "destination": ["b@h"], "reply": False})
    assert outcome.missing == ("b@h",) and [a.worker for a in outcome.skipped] == ["cpu@h"]
    assert [a.worker for a in outcome.answers] == ["a@h", "c@h"] and not outcome.ok
    # named workers: only those, and a worker that runs no model is a failure then
    fake.sent.clear()
    outcome = control(_App(fake), UNLOAD, "x", _entries(), workers=["cpu@h"],  # type: ignore[arg-type]
                      grace_s=3)
    assert fake.sent[0][1]["arguments"] == {"model": "x", "grace_s": 3.0}
    assert not outcome.ok and outcome.failed[0].error == "it is no device worker"
    assert control(_App(fake), UNLOAD, "gone", _entries()).nobody  # type: ignore[arg-type]
    # devices: the workers that say they are on one of them
    fake.replies["a@h"] = {"ok": True, "device": "cuda:0"}
    fake.replies["c@h"] = {"ok": True, "device": "cpu"}
    fake.sent.clear()
    outcome = control(_App(fake), LOAD, "x", _entries(), devices=["cuda:0"])  # type: ignore[arg-type]
    assert fake.sent[0][0] == "asyncinfer_repository" and fake.sent[0][1]["destination"] is None
    assert fake.sent[1][1]["destination"] == ["a@h"] and outcome.ok
    assert control(_App(fake), LOAD, "x", _entries(),  # type: ignore[arg-type]
                   devices=["npu:3"]).nobody == "no live device worker on npu:3 answered"
    with pytest.raises(ValueError, match="load or unload"):
        control(_App(fake), "reload", "x", _entries())  # type: ignore[arg-type]


def test_a_command_waits_until_each_worker_listens_and_is_never_sent_into_the_void() -> None:
    # Given a@h in the catalogue but deaf to its first two pings (a starting worker whose control
    # channel is not subscribed yet: a command sent then would be lost), b@h listening
    fake = _Control([], {"a@h": {"ok": True}, "b@h": {"ok": True}}, deaf={"a@h": 2})
    # When mlp is unloaded from both
    outcome = control(_App(fake), UNLOAD, "mlp", _entries(), timeout_s=30)  # type: ignore[arg-type]
    # Then b@h gets it at once, a@h once it answered a ping, and both answered
    assert outcome.ok, outcome.message()
    assert [a.worker for a in outcome.answers] == ["a@h", "b@h"]
    assert fake.pinged == [["a@h", "b@h"], ["a@h"], ["a@h"]]
    assert [(c, s["destination"]) for c, s in fake.sent] == [
        ("asyncinfer_unload_model", ["b@h"]), ("asyncinfer_unload_model", ["a@h"])]


def test_the_repository_index_in_tritons_form() -> None:
    workers = {"a@h": {"loadable": ["identity", "mlp", "gone"]},
               "c@h": {"loadable": ["identity"]}}
    rows = repository_index(_entries(), workers)
    assert rows == [
        {"name": "gone", "version": "1", "state": "UNAVAILABLE",
         "reason": "no live worker hosts it (unloaded, or its workers stopped); its requests wait "
                   "in its queue"},
        {"name": "identity", "version": "", "state": "UNAVAILABLE",
         "reason": "not loaded (loadable on a@h, c@h)"},
        {"name": "mlp", "version": "1", "state": "READY", "reason": ""}]
    assert [r["name"] for r in repository_index(_entries(), workers, ready_only=True)] == ["mlp"]


def test_a_loadable_version_is_listed_as_its_model_and_version_until_it_is_loaded() -> None:
    # Given mlp version 1 in the catalogue, and a worker that could load mlp@2 and mlp@1
    workers = {"a@h": {"loadable": ["mlp", "mlp@1", "mlp@2"]}}
    rows = [r for r in repository_index(_entries(), workers) if r["name"] == "mlp"]
    # Then version 2 is mlp's, not a model "mlp@2"; version 1, hosted, is listed once
    assert rows == [
        {"name": "mlp", "version": "1", "state": "READY", "reason": ""},
        {"name": "mlp", "version": "2", "state": "UNAVAILABLE",
         "reason": "not loaded (loadable on a@h)"}]


def test_the_repository_index_says_why_a_model_failed_to_load() -> None:
    workers = {"a@h": {"loadable": ["mlp", "bad"], "failed": {"bad": "ValueError: bad.pt is a "
                                                                      "pickle"}},
               "c@h": {"loadable": ["bad"]}}
    bad, = [r for r in repository_index(_entries(), workers) if r["name"] == "bad"]
    assert bad == {"name": "bad", "version": "", "state": "UNAVAILABLE",
                   "reason": "failed to load (a@h: ValueError: bad.pt is a pickle)"}


def test_the_gateways_load_parameters() -> None:
    assert control_options("m", "load", {}) == {"workers": [], "devices": [], "timeout_s": 60.0,
                                                "grace_s": None, "version": ""}
    assert control_options("m", "unload", {"workers": "a@h, b@h", "timeout_s": "5", "version": 2,
                                           "grace_s": 2, "unload_dependents": False}) == {
        "workers": ["a@h", "b@h"], "devices": [], "timeout_s": 5.0, "grace_s": 2.0,
        "version": "2"}
    assert control_options("m", "load", {"devices": "cuda:0,cpu"})["devices"] == ["cuda:0", "cpu"]
    for parameters, message in (({"config": "{}"}, "parameter 'config' is not supported"),
                                ({"file:1/model.pt": b""}, "'file:1/model.pt' is not supported"),
                                ({"workers": 3}, "'workers' must be a string"),
                                ({"version": "../2"}, "'version' must be a version"),
                                ({"workers": "a@h", "devices": "cpu"}, "workers or devices, not both"),
                                ({"timeout_s": 0}, "'timeout_s' must be a number of seconds"),
                                ({"grace_s": True}, "'grace_s' must be a number")):
        with pytest.raises(GatewayError, match=message) as caught:
            control_options("m", "load", parameters)
        assert caught.value.status == 400


class _Plus(Model):
    """``input`` FP32 → ``output`` = input + its version's number."""

    name = "plus"

    def forward(self, batch: Any) -> Any:
        return {"output": batch["input"] + float(self.version)}


def _plus(value: float, version: str = "") -> dict:
    request = {"model": "plus", "inputs": [{"name": "input", "shape": [1, 1], "datatype": "FP32",
                                            "data": [value]}]}
    if version:
        request["parameters"] = {"model_version": version}
    return request


def test_versions_side_by_side_routed_by_the_request(tmp_path) -> None:
    settings = dataclasses.replace(Settings.from_env(device="cpu"), models=("plus",),
                                   metrics_port=0, model_dir="")
    runtime = WorkerRuntime(settings)
    runtime.registry.register("plus", _Plus)
    runtime.registry.register("plus@2", _Plus)
    runtime.load(["plus"])

    def run(version: str = "") -> tuple[float, str | None]:
        out = runtime.infer("r", _plus(10.0, version), worker="w")
        return out["outputs"][0]["data"][0], out["parameters"].get("model_version")

    try:
        assert run() == (11.0, None)  # one version: nothing changes
        assert runtime.key_for("plus", "2") == "plus@2" and runtime.key_for("plus", "1") == "plus"
        with pytest.raises(UnknownModel, match="no version '3' registered .*'plus@3'"):
            runtime.key_for("plus", "3")
        assert runtime.load_one("plus@2")
        assert runtime.versions_of("plus") == {"plus": "1", "plus@2": "2"}
        # the latest by default, either by name
        assert run() == (12.0, "2") and run("1") == (11.0, "1") and run("2") == (12.0, "2")
        with pytest.raises(UnknownModel, match=r"^Request for unknown model: 'plus' version 7 is not "
                                               r"found \(request r\): not on this worker \(versions "
                                               r"here: 1, 2\)"):
            run("7")
        # version 2 leaves: routed no more, then unloaded; version 1 serves everything
        runtime.unhost("plus@2")
        assert run() == (11.0, None)
        with pytest.raises(UnknownModel, match="^Request for unknown model: 'plus' version 2 is not found"):
            run("2")
        runtime.unload("plus@2")
        assert runtime.models == ["plus"] and run("1") == (11.0, "1")
    finally:
        runtime.close()


def test_a_worker_announces_one_entry_per_model_with_its_versions(tmp_path) -> None:
    from asyncinfer.worker.worker import announced_models

    settings = dataclasses.replace(Settings.from_env(device="cpu"), models=("plus",),
                                   metrics_port=0, model_dir="")
    runtime = WorkerRuntime(settings)
    runtime.registry.register("plus", _Plus)
    runtime.registry.register("plus@10", _Plus)
    runtime.registry.register("plus@2", _Plus)
    runtime.load(["plus"])
    try:
        runtime.load_one("plus@10")
        runtime.load_one("plus@2")
        [meta] = announced_models(runtime.by_model(), set())
        assert meta["name"] == "plus" and meta["versions"] == ["1", "2", "10"]
        [meta] = announced_models(runtime.by_model(), {"plus@10"})
        assert meta["versions"] == ["1", "2"]
        assert announced_models(runtime.by_model(), {"plus", "plus@2", "plus@10"}) == []
    finally:
        runtime.close()


def test_the_gateway_refuses_load_and_unload_unless_its_mode_is_explicit() -> None:
    from asyncinfer.gateway.model_control import NOT_ALLOWED, check_allowed

    # Given the default mode (none), a load and an unload are refused in Triton's words, saying how
    # to allow them (Triton answers UNAVAILABLE over gRPC)
    for action in ("load", "unload"):
        with pytest.raises(GatewayError) as refused:
            check_allowed(Settings().model_control_mode, action)
        assert refused.value.status == 400 and refused.value.grpc_code == "UNAVAILABLE"
        assert refused.value.message.startswith(
            "explicit model load / unload is not allowed if polling is enabled: ")
        assert NOT_ALLOWED == "explicit model load / unload is not allowed if polling is enabled"
        assert f"refuses a repository {action}" in refused.value.message
        assert "--model-control-mode explicit" in refused.value.message
        assert "ASYNCINFER_MODEL_CONTROL_MODE=explicit" in refused.value.message
    # When the operator chose explicit, Then nothing is refused
    check_allowed(Settings(model_control_mode="explicit").model_control_mode, "unload")
