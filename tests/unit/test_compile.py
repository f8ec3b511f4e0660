"""The ``compile`` model option (engine/compile.py): unit tier. MiniLM's TorchScript forward is
checked against sentence-transformers in tests/integration/test_minilm.py."""

from __future__ import annotations

import logging

import pytest
import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.engine.compile import compile_model
from asyncinfer.models.base import Batch, Model


class Plain(Model):
    name = "plain"

    def forward(self, batch: Batch) -> Batch:
        return batch


class Failing(Plain):
    name = "failing"

    def compile(self, mode: str, device: torch.device) -> bool:
        raise ValueError("the traced forward differs from eager on 3 texts")


def test_eager_unless_asked() -> None:
    assert compile_model(Plain(), torch.device("cpu"), ModelOptions()) is False


def test_a_model_that_cannot_compile_runs_eager_and_the_worker_says_so(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="asyncinfer.engine.compile"):
        assert compile_model(Plain(), torch.device("cpu"), ModelOptions(compile="torchscript")) is False
        assert compile_model(Failing(), torch.device("cpu"), ModelOptions(compile="torchscript")) is False
    assert "model plain does not support compile=torchscript; running eager" in caplog.text
    assert ("model failing: compile=torchscript raised ValueError: the traced forward differs "
            "from eager on 3 texts; running eager") in caplog.text


def test_an_unknown_mode_is_refused_naming_the_ones_there_are() -> None:
    with pytest.raises(ValueError, match=r"compile must be one of \['', 'torchscript'\], got 'inductor'"):
        ModelOptions(compile="inductor")
    assert ModelOptions().merged({"compile": "torchscript"}).compile == "torchscript"
