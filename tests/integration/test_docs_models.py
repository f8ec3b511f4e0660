"""docs/models.md's examples run as written: every block marked ``<!-- models-example: FILE -->``
is written into a folder under that name, every ``run`` block runs there (the model files and the
repository they make), the ``serve`` block's worker line serves them (one worker, with the
``ASYNCINFER_MODEL_FACTORIES`` that block exports) against this test's Redis, and the ``call``
script prints exactly the page's ``output`` block; the ``triton`` script, through one gateway,
prints its ``triton-output`` block. The README's model-repository commands run in the same folder,
served by the same worker (its TorchScript file written as they write it, its tritonclient line
answered through the gateway)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import (
    ROOT,
    WorkerProcess,
    launch_gateway,
    ready_together,
    stop_together,
    worker_env,
)

pytestmark = pytest.mark.timeout(300)

PAGE = ROOT / "docs" / "models.md"
#: A marked block: the marker's word, then the fenced block after it.
_MARKED = re.compile(r"<!-- models-example: (\S+) -->\n```[a-z]*\n(.*?)^```", re.S | re.M)
#: Markers that are not files of the folder.
_ROLES = ("run", "serve", "call", "output", "triton", "triton-output")


def page_examples() -> list[tuple[str, str]]:
    """Each marked block of the page: (its marker, its text), in page order."""
    return _MARKED.findall(PAGE.read_text())


def _one(blocks: list[tuple[str, str]], role: str) -> str:
    found = [text for marker, text in blocks if marker == role]
    assert len(found) == 1, f"docs/models.md has {len(found)} '{role}' blocks, wants one"
    return found[0]


def _worker_argv(serve: str) -> tuple[list[str], str]:
    """The serve block's ``asyncinfer worker`` line as an argv, and the factories it exports."""
    factories = re.search(r'^export ASYNCINFER_MODEL_FACTORIES="([^"]+)"', serve, re.M)
    line = next(line for line in serve.splitlines() if line.startswith("asyncinfer worker "))
    words = shlex.split(line, comments=True)
    assert factories and words[:2] == ["asyncinfer", "worker"], serve
    return [sys.executable, "-m", "asyncinfer", *words[1:]], factories.group(1)


def readme_repository() -> tuple[str, str]:
    """The README's model-repository commands: the one that saves the model, and the call."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- readme-repository-example[^>]*-->\n```sh\n(.*?)```", text, re.S)
    assert block, "README.md lost its marked model-repository commands"
    lines = [shlex.split(line, comments=True) for line in block.group(1).splitlines()]
    codes = [words[2] for words in lines if words[:2] == [".venv/bin/python", "-c"]]
    assert len(codes) == 2 and "torch.jit.save" in codes[0] and "tritonclient" in codes[1], codes
    assert [".venv/bin/asyncinfer", "up", "--detach", "--model-dir", "models"] in lines
    return codes[0], codes[1]


def _python(code: str, folder: Path, env: dict[str, str] | None = None,
            ) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], cwd=folder, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finished(proc: subprocess.Popen[str], what: str) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{err[-3000:]}"
    return out


def test_the_page_marks_each_way_to_bring_a_model() -> None:
    blocks = page_examples()
    files = [marker for marker, _ in blocks if marker not in _ROLES]
    assert files == ["my_models.py", "net.py", "models/net/config.pbtxt", "models/net/3/model.py"]
    runs = [text for marker, text in blocks if marker == "run"]
    for made in ("models/scripted.pt", "models/exported.pt2", "models/onnxnet.onnx",
                 "models/net/1/model.pt", "models/net/2/model.onnx"):
        assert sum(f'"{made}"' in text for text in runs) == 1, made


def test_the_page_examples_run_as_written(redis_db: Any, tmp_path: Path) -> None:
    blocks = page_examples()
    folder = tmp_path / "app"
    folder.mkdir()
    # Given the page's files written where it names them, and its scripts run there
    for marker, text in blocks:
        if marker not in _ROLES:
            (folder / marker).parent.mkdir(parents=True, exist_ok=True)
            (folder / marker).write_text(text)
    readme_save, readme_call = readme_repository()
    (folder / "models" / "linear" / "1").mkdir(parents=True)  # the README's mkdir
    runs = [_python(text, folder) for marker, text in blocks if marker == "run"]
    runs.append(_python(readme_save, folder))
    for i, proc in enumerate(runs):
        _finished(proc, f"run block {i + 1}")
    # When one worker serves them as the serve block says, and one gateway fronts it
    argv, factories = _worker_argv(_one(blocks, "serve"))
    argv[argv.index("--models") + 1] += ",linear"  # and the README's model
    env = worker_env(redis_db.url, ASYNCINFER_MODEL_FACTORIES=factories)
    worker = WorkerProcess(argv, env, tmp_path / "worker.log", cwd=folder)
    gateway = launch_gateway(redis_db.url, tmp_path / "gateway.log")
    try:
        ready_together([worker, gateway], 120.0)
        # Then the call script prints the page's output, exactly
        out = _finished(_python(_one(blocks, "call"), folder, worker_env(redis_db.url)),
                        "the call script")
        assert out == _one(blocks, "output"), worker.log()[-3000:]
        # And tritonclient, through the gateway, prints the page's too
        triton = _one(blocks, "triton")
        assert '"localhost:8000"' in triton
        triton = triton.replace('"localhost:8000"', f'"{gateway.http_url}"')
        out = _finished(_python(triton, folder, worker_env(redis_db.url)), "the triton script")
        assert out == _one(blocks, "triton-output")
        assert '"localhost:8000"' in readme_call
        readme_call = readme_call.replace('"localhost:8000"', f'"{gateway.http_url}"')
        out = _finished(_python(readme_call, folder, worker_env(redis_db.url)),
                        "the README's tritonclient line")
        assert out == "(3, 2)\n"
    finally:
        stop_together([worker, gateway])
