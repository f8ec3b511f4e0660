"""Triton's words (wire/triton_words.py), as Triton's core and server write them: the texts its
clients and tools match on."""

from __future__ import annotations

import pytest

from asyncinfer.wire import triton_words


def test_the_texts_are_tritons() -> None:
    # core: ModelRepositoryManager::FindModelIdentifier / GetModel + ModelLifeCycle::GetModel
    assert triton_words.unknown_model("x") == "Request for unknown model: 'x' is not found"
    assert triton_words.unknown_model("x", "3") == "Request for unknown model: 'x' version 3 is not found"
    # server: GetModelVersionFromString
    assert triton_words.bad_version("wrong_specification") == (
        "failed to get model version from specified version string 'wrong_specification'")
    assert triton_words.bad_version("-1") == "invalid model version specified '-1'"
    # core: LoadUnloadModels, LoadUnloadModel
    assert triton_words.load_failed("m") == "load failed for model 'm'"
    assert triton_words.unload_failed("m") == "failed to unload 'm'"
    # server: grpc/infer_handler.cc
    assert triton_words.contents_and_raw("INPUT0", "simple") == (
        "contents field must not be specified when using raw_input_contents for 'INPUT0' for "
        "model 'simple'")
    assert triton_words.no_input_data("INPUT1", "simple") == (
        "unable to find data for input tensor 'INPUT1' for model 'simple' in request")


@pytest.mark.parametrize(("version", "valid"), [
    ("1", True), ("12", True), ("v2", True), ("", False), ("-1", False), ("..", False),
    ("wrong_specification", False), ("1 ", False), ("\x00", False), ("²", False)])
def test_a_version_is_letters_and_digits(version: str, valid: bool) -> None:
    assert triton_words.is_version(version) is valid


def test_each_text_leads() -> None:
    for text in (triton_words.unknown_model("x"), triton_words.bad_version("a.b"),
                 triton_words.bad_version("-3"), triton_words.load_failed("m"),
                 triton_words.unload_failed("m"), triton_words.contents_and_raw("a", "m"),
                 triton_words.no_input_data("a", "m")):
        assert triton_words.leads(f"{text}: why")
    assert not triton_words.leads("request r1: Request for unknown model: 'x' is not found")
