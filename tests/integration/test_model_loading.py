"""Loading that says what broke and keeps serving, end to end: real Redis, real ``asyncinfer
worker`` processes (the installed command, not ``python -m``, where it matters).

A factory's module in the working directory imports under ``asyncinfer worker`` as under
``asyncinfer up``; a factory that cannot be imported ends the worker with exit status 78 and one
line. A bad model file of the default set (no ``--models``) fails its own load, is logged once
naming itself, and the worker serves the others (the repository index says why it is
UNAVAILABLE); named by ``--models``, it stops the worker with exit status 78 and one line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.errors import UnknownModel
from asyncinfer.supervision.supervisor import CANNOT_START
from tests.support.processes import TEST_FACTORIES, WorkerProcess, worker_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(180)

#: The installed ``asyncinfer`` command: unlike ``python -m asyncinfer``, it does not put the
#: working directory on the import path by itself.
COMMAND = str(Path(sys.executable).parent / "asyncinfer")

MYMODELS = '''
from asyncinfer.models import InputSpec, Model, OutputSpec


class Double(Model):
    inputs = {"x": InputSpec(("FP32",), (-1,))}
    outputs = {"y": OutputSpec("FP32", (-1,))}

    def forward(self, batch):
        return {"y": batch["x"] * 2}


def make():
    return Double()
'''


def _client(url: str) -> Client:
    return Client(settings=Settings.from_env(environ={"ASYNCINFER_BROKER_URL": url}))


def _index_with(client: Client, name: str) -> dict[str, dict[str, str]] | None:
    """The repository index by name, once it lists ``name`` (None before)."""
    rows = {r["name"]: r for r in client.repository_index()}
    return rows if name in rows else None


def _env(url: str, **extra: str) -> dict[str, str]:
    env = worker_env(url, **extra)
    env.pop("ASYNCINFER_MODEL_FACTORIES")  # only what the test sets
    env.update(extra)
    return env


def _worker(url: str, folder: Path, *args: str, **env: str) -> WorkerProcess:
    return WorkerProcess([COMMAND, "worker", "--device", "cpu", *args], _env(url, **env),
                         folder / "worker.log", cwd=folder)


def _cannot_start(url: str, folder: Path, *args: str, **env: str) -> list[str]:
    """The worker's stderr lines; it must have exited 78 with no traceback."""
    out = subprocess.run([COMMAND, "worker", "--device", "cpu", *args], capture_output=True,
                         text=True, timeout=120, cwd=folder, env=_env(url, **env))
    assert out.returncode == CANNOT_START, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "celery@" not in out.stdout + out.stderr
    return [line for line in out.stderr.splitlines() if line.strip()]


# -- factories -----------------------------------------------------------------------------------

def test_a_factory_beside_the_command_is_served(redis_db, tmp_path) -> None:
    # Given mymodels.py in the folder the command runs in, on no PYTHONPATH
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    worker = _worker(redis_db.url, tmp_path, "--models", "mymlp",
                     ASYNCINFER_MODEL_FACTORIES="mymlp=mymodels:make")
    try:
        worker.wait_ready()
        # When a request names it, Then the worker answers it
        with _client(redis_db.url) as client:
            response = client.infer("mymlp", {"x": np.array([[1, 2, 3]], np.float32)},
                                    timeout_s=30)
        assert response["y"].tolist() == [[2.0, 4.0, 6.0]]
    finally:
        worker.stop()


@pytest.mark.parametrize(("module", "entry", "reason"), [
    (None, "mymlp=mymodels:make",
     "model factory 'mymlp' (mymodels:make): cannot import module 'mymodels': No module named "
     "'mymodels' (neither in the working directory {folder} nor among the installed packages)"),
    ("raise RuntimeError('no weights here')\n", "mymlp=mymodels:make",
     "model factory 'mymlp' (mymodels:make): importing module 'mymodels' raised RuntimeError: "
     "no weights here"),
    (MYMODELS, "mymlp=mymodels:nosuch",
     "model factory 'mymlp' (mymodels:nosuch): module 'mymodels' has no attribute 'nosuch'"),
])
def test_a_factory_that_cannot_be_imported_stops_the_worker_with_one_line(
        redis_db, tmp_path, module, entry, reason) -> None:
    if module is not None:
        (tmp_path / "mymodels.py").write_text(module)
    lines = _cannot_start(redis_db.url, tmp_path, ASYNCINFER_MODEL_FACTORIES=entry)
    assert lines == [f"asyncinfer worker: cannot start: {reason.format(folder=tmp_path)}"]


# -- model files ---------------------------------------------------------------------------------

def _model_folder(folder: Path) -> Path:
    """``good.pt`` (a TorchScript MLP) and ``pickled.pt`` (the same module, ``torch.save``d)."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    models = folder / "models"
    models.mkdir()
    torch.jit.save(torch.jit.script(mlp), str(models / "good.pt"))
    torch.save(mlp, str(models / "pickled.pt"))
    return models


PICKLED = ("model 'pickled': {models}/pickled.pt is a pickle (torch.save), not a TorchScript or "
           "torch.export file; save it with torch.jit.save(torch.jit.script(model), 'NAME.pt') "
           "or torch.export.save(torch.export.export(model, example_inputs), 'NAME.pt2')")


def test_a_pickle_in_the_default_set_is_left_out_and_the_others_serve(redis_db, tmp_path) -> None:
    # Given a model folder with a good file and a torch.save pickle, and a worker told no models
    models = _model_folder(tmp_path)
    worker = _worker(redis_db.url, tmp_path, ASYNCINFER_MODEL_DIR=str(models))
    try:
        worker.wait_ready()
        reason = PICKLED.format(models=models)
        with _client(redis_db.url) as client:
            # When a request names the good file, Then it answers, as the built-ins do
            x = np.ones((3, 4), np.float32)
            assert client.infer("good", x, timeout_s=30)["output"].shape == (3, 2)
            assert client.infer("identity", {"t": x}, timeout_s=30)["t"].shape == (3, 4)
            # and the pickle is reported once, naming itself and the rule
            log = worker.log()
            assert log.count(reason) == 1
            assert f"model pickled failed to load on cpu and is not served: ValueError: {reason}" \
                in log
            # and the repository index lists it UNAVAILABLE with the reason
            rows = wait_for(lambda: _index_with(client, "pickled"), 30, "pickled in the index")
            assert rows["good"]["state"] == "READY"
            assert rows["pickled"]["state"] == "UNAVAILABLE"
            assert reason in rows["pickled"]["reason"]
            assert "not loaded" not in rows["pickled"]["reason"]
            # and its queue is not taken: a request for it is refused as unknown (never announced)
            with pytest.raises(UnknownModel, match="pickled"):
                client.infer("pickled", x, timeout_s=10)
        assert "infer.pickled" not in log.split(f"ValueError: {reason}", 1)[1]
    finally:
        worker.stop()


def test_a_pickle_named_by_models_stops_the_worker_with_one_line(redis_db, tmp_path) -> None:
    models = _model_folder(tmp_path)
    lines = _cannot_start(redis_db.url, tmp_path, "--models", "good,pickled",
                          ASYNCINFER_MODEL_DIR=str(models))
    assert lines[-1] == (f"asyncinfer worker: cannot start: loading pickled failed: ValueError: "
                         f"{PICKLED.format(models=models)}")


def test_a_failed_load_names_only_the_model_that_failed(redis_db, tmp_path) -> None:
    # `broken` (tests/support/models.py) raises in its load; identity loads
    lines = _cannot_start(redis_db.url, tmp_path, "--models", "identity,broken",
                          ASYNCINFER_MODEL_FACTORIES=TEST_FACTORIES)
    assert lines[-1] == ("asyncinfer worker: cannot start: loading broken failed: OSError: weights "
                         "file is truncated")
