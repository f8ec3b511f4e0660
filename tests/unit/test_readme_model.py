"""The README's own model ("Your own model, served and called") is registered by the factory entry
its commands export, accepts what their `asyncinfer infer` line sends and answers what that line's
comment shows: checked in process, the model file written as the README names it (the commands
themselves serve it with `asyncinfer up`)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from asyncinfer.models.registry import Registry

ROOT = Path(__file__).resolve().parents[2]


def readme_model() -> tuple[str, str, str]:
    """The model file's name and text, and the shell block that serves and calls it."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Your own model, served and called", 1)[1].split("\n## ", 1)[0]
    source = re.search(r"```python\n# (\w+\.py)\n(.*?)```", section, re.S)
    commands = re.search(r"```sh\n(.*?)```", section, re.S)
    assert source and commands, "README.md's own-model section lost its Python or shell block"
    return source.group(1), source.group(2), commands.group(1)


def test_the_readme_model_serves_what_its_commands_send(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    file_name, source, commands = readme_model()
    (tmp_path / file_name).write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, file_name[:-3], raising=False)
    # Given the factory entry the commands export
    entry = re.search(r'ASYNCINFER_MODEL_FACTORIES="([^"]+)"', commands).group(1)
    name = entry.split("=", 1)[0]
    model = Registry.from_config([entry]).create(name)
    model.load(torch.device("cpu"))
    # When the `asyncinfer infer` line's input is checked and run
    infer = next(line for line in commands.splitlines() if f"infer {name}" in line)
    sent = json.loads(shlex.split(infer, comments=True)[1])
    (input_name, rows), = sent.items()
    value = torch.tensor(rows, dtype=torch.float32)
    model.inputs[input_name].check("r1", input_name, "FP32", tuple(value.shape))
    (output_name, out), = model.forward({input_name: value}).items()
    # Then it answers what the comment shows, under a declared output
    shown = json.loads(re.search(r'"data":(\[[^]]*\])', infer).group(1))
    assert output_name in model.outputs
    assert out.flatten().tolist() == shown
