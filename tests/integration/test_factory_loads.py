"""A factory model's new version loads hot, named in the load command (worker/factory_loads.py):
a real Redis, a real worker process started in a folder holding the factory's module, requests
flowing meanwhile; and a module its operator did not allow refused, naming the setting."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.ops.fleet_commands import cmd_model_control
from tests.support.processes import WorkerProcess, worker_env

pytestmark = pytest.mark.timeout(240)

HOST = socket.gethostname()
HOT = '''
from asyncinfer.models import InputSpec, Model


class Plus(Model):
    inputs = {"x": InputSpec(("FP64",), (3,))}

    def __init__(self, n):
        self.n = n

    def forward(self, batch):
        return {"y": batch["x"] + self.n}


def make_v1():
    return Plus(1.0)
'''
#: Written into the same file once the worker serves version 1.
MAKE_V2 = '''

def make_v2():
    return Plus(2.0)
'''
#: A module nobody allowed: importing it leaves a mark.
EVIL = '''
open("evil-was-imported", "w").close()


def make():
    raise AssertionError("never called")
'''


def _worker(url: str, folder: Path) -> WorkerProcess:
    """``asyncinfer worker`` (the installed command, which puts its working directory on the
    import path itself) run in ``folder``, serving m from ``hotmodels.py`` there;
    ASYNCINFER_LOADABLE_FACTORIES unset: hotmodels alone may be named in a load."""
    env = worker_env(url, ASYNCINFER_MODEL_FACTORIES="m=hotmodels:make_v1")
    argv = [str(Path(sys.executable).parent / "asyncinfer"), "worker", "--device", "cpu",
            "--models", "m", "--hostname", f"a@{HOST}"]
    return WorkerProcess(argv, env, folder / "worker.log", cwd=folder)


def _control_args(url: str, **options: object) -> argparse.Namespace:
    """What ``asyncinfer models load ...`` parses into (ops/fleet_commands.py)."""
    defaults: dict[str, object] = {"broker_url": url, "action": "load", "model": "m",
                                   "version": "", "workers": None, "devices": None,
                                   "timeout_s": 120.0, "json": True, "factory": None}
    return argparse.Namespace(**{**defaults, **options})


def test_a_new_factory_version_loads_hot_while_requests_flow(redis_db, tmp_path, capsys) -> None:
    folder = tmp_path / "app"
    folder.mkdir()
    (folder / "hotmodels.py").write_text(HOT)
    (folder / "evil.py").write_text(EVIL)
    worker = _worker(redis_db.url, folder).wait_ready()
    client = Client(settings=Settings.from_env(environ={"ASYNCINFER_BROKER_URL": redis_db.url}))
    x = np.array([[1.0, 2.0, 3.0]])
    stop, calls = threading.Event(), threading.Event()
    answered: Counter[str] = Counter()
    failures: list[str] = []

    def keep_calling() -> None:
        while not stop.is_set():
            try:
                y = client.infer("m", {"x": x}, timeout_s=60)["y"].tolist()
                answered[str(y)] += 1
            except Exception as exc:  # noqa: BLE001 - counted: the test wants none
                failures.append(f"{type(exc).__name__}: {exc}")
            calls.set()

    caller = threading.Thread(target=keep_calling)
    try:
        # Given a worker serving m (version 1, from hotmodels:make_v1) and calls to m flowing
        caller.start()
        assert calls.wait(60)
        v1, v2 = (x + 1).tolist(), (x + 2).tolist()
        # When make_v2 is written into the same module and a load names it as version 2
        (folder / "hotmodels.py").write_text(HOT + MAKE_V2)
        outcome = client.load_model("m", version="2", factory="hotmodels:make_v2",
                                    timeout_s=120)
        # Then it loaded there, beside version 1
        assert outcome.ok, outcome.message()
        [answer] = outcome.answers
        assert (answer.worker, answer.reply["version"], answer.reply["factory"],
                answer.reply["loaded"]) == (f"a@{HOST}", "2", "hotmodels:make_v2", True)
        assert client.models()["m"].versions == ["1", "2"]
        before = sum(answered.values())
        calls.clear()
        assert calls.wait(60)
        stop.set()
        caller.join(60)
        # and no call failed meanwhile; those after the load got version 2's answers
        assert failures == [] and sum(answered.values()) > before
        assert set(answered) <= {str(v1), str(v2)}
        with capsys.disabled():
            print(f"answers while version 2 loaded: {dict(answered)}")
        latest = client.infer("m", {"x": x}, timeout_s=60)
        assert latest["y"].tolist() == v2 and latest.parameters["model_version"] == "2"
        first = client.infer("m", {"x": x}, timeout_s=60, version=1)
        assert first["y"].tolist() == v1 and first.parameters["model_version"] == "1"
        # The same command again changes nothing there
        again = client.load_model("m", version="2", factory="hotmodels:make_v2", timeout_s=120)
        assert again.ok and again.answers[0].reply["loaded"] is False

        # A module nobody allowed is refused before it is imported, naming the setting
        capsys.readouterr()
        code = cmd_model_control(_control_args(redis_db.url, version="3", factory="evil:make"))
        refused = json.loads(capsys.readouterr().out)
        assert code == 1 and refused["ok"] is False
        assert refused["workers"][0]["error"].startswith(
            "cannot load model 'm' version '3': factory evil:make: module 'evil' is not allowed "
            "by ASYNCINFER_LOADABLE_FACTORIES on this worker (unset, it allows the modules of "
            "ASYNCINFER_MODEL_FACTORIES: hotmodels);")
        assert not (folder / "evil-was-imported").exists()
        # A factory that is not there answers one line, and leaves no version 4 registered
        missing = client.load_model("m", version="4", factory="hotmodels:make_v4", timeout_s=120)
        assert missing.message() == (
            f"load failed for model 'm' (version '4'): a@{HOST}: cannot load model 'm' version "
            f"'4': model factory 'm@4' (hotmodels:make_v4): module 'hotmodels' has no attribute "
            f"'make_v4'")
        unregistered = client.load_model("m", version="4", timeout_s=120)
        assert "no version '4' registered" in unregistered.message()
        # and the worker serves on, both versions
        assert client.infer("m", {"x": x}, timeout_s=60)["y"].tolist() == v2
        assert "Traceback" not in worker.log()
    finally:
        stop.set()
        if caller.is_alive():
            caller.join(60)
        client.close()
        worker.stop()
