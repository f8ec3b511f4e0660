"""Failures that say what to do, in process: settings, device and model checks, CLI hints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from celery.exceptions import (
    SoftTimeLimitExceeded,
    TaskRevokedError,
    TimeLimitExceeded,
    WorkerLostError,
)

from asyncinfer.celery_app import create_app
from asyncinfer.config.settings import Settings
from asyncinfer.config.settings_report import setting_sources
from asyncinfer.engine.device import DeviceSpec
from asyncinfer.errors import BrokerUnavailable, InvalidRequest, ModelError
from asyncinfer.models.registry import Registry
from asyncinfer.ops.cli_io import failure_line
from asyncinfer.ops.cli_io import with_datatype_hint as _with_datatype_hint
from asyncinfer.worker.launch import WorkerCannotStart, check_device, check_models


def test_a_broker_url_that_is_no_url_is_named_as_such() -> None:
    with pytest.raises(ValueError) as caught:
        Settings.from_env({"ASYNCINFER_BROKER_URL": "notaurl"})
    said = str(caught.value)
    assert said.startswith("ASYNCINFER_BROKER_URL (or --broker-url) is not a URL: 'notaurl'; ")
    assert "redis://[:password@]host:6379/0" in said and "result backend" not in said


def test_a_result_backend_that_is_no_url_is_named_and_its_password_not_shown() -> None:
    with pytest.raises(ValueError) as caught:
        Settings(broker_url="redis://h:6379/0", result_backend="user:s3cret@host:6379")
    said = str(caught.value)
    assert said.startswith("ASYNCINFER_RESULT_BACKEND is not a URL: '…@host:6379'")
    assert "s3cret" not in said


def test_every_url_scheme_in_use_is_accepted() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://h:6380/1", "unix:///tmp/r.sock",
                "sentinel://a:26379;sentinel://b:26379/2", "amqp://u:p@h:5672//", "memory://"):
        assert Settings(broker_url=url).broker_url == url


def test_setting_sources_name_flag_environment_and_default() -> None:
    sources = setting_sources({"ASYNCINFER_CONCURRENCY": "8", "ASYNCINFER_DEVICE": ""},
                              broker_url="redis://h:6379/0", device=None)
    assert sources["broker_url"] == "flag"
    assert sources["concurrency"] == "environment (ASYNCINFER_CONCURRENCY)"
    assert sources["device"] == "default"
    assert set(sources) == set(vars(Settings()))


def test_broker_url_origin_is_configured_published_or_default(tmp_path: Path) -> None:
    assert Settings(broker_url="redis://h:6379/0").broker_url_origin() == "configured"
    settings = Settings(state_dir=str(tmp_path))
    assert settings.broker_url_origin() == "default"
    settings.redis_dir.mkdir(parents=True)
    (settings.redis_dir / "broker_url").write_text("redis://127.0.0.1:7/0\n")
    (settings.redis_dir / "redis.pid").write_text(f"{os.getpid()}\n")  # a live process
    assert settings.broker_url_origin() == "published"
    assert settings.resolved_broker_url() == "redis://127.0.0.1:7/0"


def test_a_client_with_the_default_broker_says_nothing_was_configured(tmp_path: Path) -> None:
    from asyncinfer.client import Client

    with Client(settings=Settings(state_dir=str(tmp_path))) as guessed:
        said = str(guessed._broker_error(BrokerUnavailable("request r: broker unreachable: refused")))
    assert said == ("request r: broker unreachable: refused (no broker configured: "
                    "ASYNCINFER_BROKER_URL is unset and no 'asyncinfer up' runs on this host, so "
                    "the default redis://127.0.0.1:6379/0 was tried)")
    with Client(settings=Settings(broker_url="redis://127.0.0.1:1/0")) as configured:
        error = BrokerUnavailable("request r: broker unreachable: refused")
        assert configured._broker_error(error) is error


def test_npu_without_torch_npu_names_the_extra_and_cann() -> None:
    pytest.importorskip("torch")
    try:
        import torch_npu  # noqa: F401
        pytest.skip("torch_npu is installed")
    except ImportError:
        pass
    with pytest.raises(WorkerCannotStart) as caught:
        check_device(DeviceSpec("npu", 0))
    said = str(caught.value)
    assert said.startswith("device npu:0: needs torch_npu, which is not installed")
    assert "'asyncinfer[npu]' (the npu extra)" in said and "CANN" in said


def test_a_device_type_torch_does_not_serve_is_not_supported() -> None:
    with pytest.raises(WorkerCannotStart) as caught:
        check_device(DeviceSpec("tpu", 0))
    assert str(caught.value) == ("device tpu:0: 'tpu' devices are not supported "
                                 "(devices: auto, cpu, cuda:N, npu:N)")


def test_a_missing_cuda_device_is_named() -> None:
    import torch

    if torch.version.cuda is None:
        with pytest.raises(WorkerCannotStart, match=r"^device cuda:0: this torch \(.*\) is built "
                                                    r"without CUDA; install a CUDA build"):
            check_device(DeviceSpec("cuda", 0))
    else:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        with pytest.raises(WorkerCannotStart, match=rf"^device cuda:{count}: no such cuda device "
                                                    rf"on this host \(.*torch sees {count}"):
            check_device(DeviceSpec("cuda", count))


def test_cpu_and_auto_always_pass() -> None:
    check_device(DeviceSpec("cpu"))
    check_device(DeviceSpec("auto"))


def test_unregistered_models_are_refused_listing_the_registered_ones() -> None:
    registry = Registry.from_config()
    with pytest.raises(WorkerCannotStart) as caught:
        check_models(["mlp", "nosuchmodel", "other"], registry)
    assert str(caught.value) == (
        f"model(s) nosuchmodel, other not registered (registered: {', '.join(registry.names())}; "
        "register others with ASYNCINFER_MODEL_FACTORIES or ASYNCINFER_MODEL_DIR)")
    check_models(["mlp", "identity"], registry)


def test_a_refused_inferred_datatype_gets_the_flag_to_pass() -> None:
    refused = InvalidRequest("request r: input 'input': datatype INT64 is not accepted "
                             "(accepted: FP32)")
    hinted = _with_datatype_hint(refused, None)
    assert isinstance(hinted, InvalidRequest)
    assert str(hinted) == (f"{refused}; the list was sent as INT64: pass --datatype FP32")
    assert _with_datatype_hint(refused, "INT64") is refused  # the user chose it
    other = InvalidRequest("request r: shape [1, 2] does not match [n, 16]")
    assert _with_datatype_hint(other, None) is other


@pytest.mark.parametrize(("words", "sent", "wanted"), [
    ("mat1 and mat2 must have the same dtype, but got Long and Float", "INT64", "FP32"),
    ("expected scalar type Float but found Long", "INT64", "FP32"),
    ("expected scalar type Double but found Float", "FP32", "FP64"),
])
def test_a_model_files_dtype_mismatch_gets_the_flag_to_pass(words: str, sent: str,
                                                            wanted: str) -> None:
    # A model file declares no inputs: a list sent as another datatype fails inside its program
    failed = ModelError(f"request r: model 'm' raised RuntimeError: {words} (in the TorchScript "
                        f"program)")
    hinted = _with_datatype_hint(failed, None)
    assert isinstance(hinted, ModelError)
    assert str(hinted) == f"{failed}; the list was sent as {sent}: pass --datatype {wanted}"
    assert _with_datatype_hint(failed, sent) is failed  # the user chose it
    shapes = ModelError("request r: model 'm' raised RuntimeError: mat1 and mat2 shapes cannot be "
                        "multiplied (1x3 and 32x4)")
    assert _with_datatype_hint(shapes, None) is shapes


class UserModelError(Exception):
    """An exception type of the worker's own code, which this process cannot import."""


UserModelError.__module__ = "somebody_elses.models"

#: Each failure as a worker stores it → the line ``asyncinfer result r-1`` says for it.
STORED_FAILURES = [
    (TimeLimitExceeded(2.0),  # Celery's pool stores the bare limit
     "asyncinfer result: TimeLimitExceeded: request r-1: time limit (2 s) exceeded"),
    (TimeLimitExceeded("request r-1: time limit (2 s) exceeded on model 'sleep'"),  # the engine's
     "asyncinfer result: TimeLimitExceeded: request r-1: time limit (2 s) exceeded on model 'sleep'"),
    (SoftTimeLimitExceeded(),
     "asyncinfer result: SoftTimeLimitExceeded: request r-1: soft time limit exceeded"),
    (SoftTimeLimitExceeded(1.5),
     "asyncinfer result: SoftTimeLimitExceeded: request r-1: soft time limit (1.5 s) exceeded"),
    (WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL) Job: 3."),
     "asyncinfer result: WorkerLostError: request r-1: its worker process died while it ran "
     "(Worker exited prematurely: signal 9 (SIGKILL) Job: 3.)"),
    (TaskRevokedError("revoked"),
     "asyncinfer result: TaskRevokedError: request r-1: revoked before a worker ran it"),
    (TaskRevokedError("expired"),
     "asyncinfer result: TaskRevokedError: request r-1: expired before a worker ran it (its "
     "expires, or the deadline of its timeout)"),
    (TaskRevokedError("terminated"),
     "asyncinfer result: TaskRevokedError: request r-1: revoked and ended while it ran"),
    (UserModelError("tokenizer missing"),  # rebuilt by Celery under its name
     "asyncinfer result: UserModelError: request r-1: tokenizer missing"),
    (MemoryError(), "asyncinfer result: MemoryError: request r-1: (no message)"),
    (KeyError("input"), "asyncinfer result: KeyError: request r-1: 'input'"),
]


@pytest.mark.parametrize(("stored", "said"), STORED_FAILURES,
                         ids=[f"{type(e).__name__}({e.args!r})" for e, _ in STORED_FAILURES])
def test_every_stored_failure_is_one_line_naming_the_request(stored: BaseException, said: str) -> None:
    # Given: the failure as the result backend stores it and the client decodes it
    backend = create_app(Settings(broker_url="redis://127.0.0.1:1/0")).backend
    decoded = backend.exception_to_python(backend.prepare_exception(stored))
    assert type(decoded).__name__ == type(stored).__name__
    # Then: one line, the request named once
    assert failure_line("result", "r-1", decoded) == said


def test_a_failure_that_names_its_request_is_not_named_twice() -> None:
    revoked = TaskRevokedError("request r-1 was revoked")
    assert failure_line("infer", "r-1", revoked) == (
        "asyncinfer infer: TaskRevokedError: request r-1 was revoked")
    other = TimeLimitExceeded("request r-10: time limit (1 s) exceeded")  # another ID's prefix
    assert failure_line("result", "r-1", other) == (
        "asyncinfer result: TimeLimitExceeded: request r-1: request r-10: time limit (1 s) exceeded")
