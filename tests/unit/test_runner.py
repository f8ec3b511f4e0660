"""ModelRunner on the CPU: batching, exact per-request rows, isolation of failures, shutdown."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.engine.completion import Completed
from asyncinfer.engine.device import Device, DeviceSpec
from asyncinfer.engine.failures import model_failure
from asyncinfer.engine.hooks import DeviceHooks
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.errors import InvalidRequest, ModelError, RequestRevoked
from asyncinfer.models.base import Batch, Model
from asyncinfer.models.builtin import Identity
from asyncinfer.wire.protocol import Request, decode_request
from tests.support.models import Poison

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0


def runner_for(model: Model, *, max_batch_size: int = 8, max_delay_ms: float = 5,
               is_revoked: Callable[[str], bool] | None = None, pipelined: bool = True) -> ModelRunner:
    # No warm-up: these models count their calls (engine/warmup.py has tests of its own)
    options = ModelOptions(max_batch_size=max_batch_size, max_delay_ms=max_delay_ms, pipelined=pipelined,
                           warmup=False)
    return ModelRunner(model, Device(DeviceSpec("cpu")), options, is_revoked=is_revoked)


@contextmanager
def started(runner: ModelRunner) -> Iterator[ModelRunner]:
    runner.start()
    try:
        yield runner
    finally:
        runner.close()


def scalar_request(request_id: str, value: float, model: str = "poison") -> Request:
    """One FP32 [1, 1] ``input`` holding ``value``."""
    return decode_request(request_id, {"model": model, "inputs": [
        {"name": "input", "shape": [1, 1], "datatype": "FP32", "data": [value]}]})


class Recording(Poison):
    """Poison that records the rows of every forward call."""

    def __init__(self) -> None:
        self.calls: list[list[float]] = []

    def forward(self, batch: Batch) -> Batch:
        self.calls.append(batch["input"].flatten().tolist())
        return super().forward(batch)


class Gate(Model):
    """``input`` → input × 2, but every forward blocks until :attr:`release` is set."""

    name = "gate"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls: list[list[float]] = []

    def forward(self, batch: Batch) -> Batch:
        self.calls.append(batch["input"].flatten().tolist())
        self.entered.set()
        if not self.release.wait(WAIT_S):
            raise TimeoutError("gate never released")
        return {"output": batch["input"] * 2}


class ExtraRow(Model):
    """Returns one row more than it was given."""

    name = "extra_row"

    def forward(self, batch: Batch) -> Batch:
        x = batch["input"]
        return {"output": torch.cat([x, x[:1]])}


def only_output(done: Completed) -> torch.Tensor:
    assert [t.name for t in done.outputs] == ["output"]
    value = done.outputs[0].value
    assert isinstance(value, torch.Tensor)
    return value


# -- (a) exact rows under concurrency --------------------------------------------------------


def identity_request(i: int) -> Request:
    """Request ``i``: 1-3 rows of INT64 [rows, 2] holding (i, row) and a BYTES label per row."""
    rows = 1 + i % 3
    return decode_request(f"req-{i}", {"model": "identity", "inputs": [
        {"name": "x", "shape": [rows, 2], "datatype": "INT64",
         "data": [v for r in range(rows) for v in (i, r)]},
        {"name": "label", "shape": [rows], "datatype": "BYTES",
         "data": [f"{i}/{r}" for r in range(rows)]},
    ]})


@pytest.mark.parametrize(("pipelined", "instances"), [(True, 1), (True, 2), (False, 1), (False, 2)])
def test_concurrent_requests_get_exactly_their_rows(pipelined: bool, instances: int) -> None:
    options = ModelOptions(max_batch_size=8, max_delay_ms=5, pipelined=pipelined, instances=instances,
                           warmup=False)
    runner = ModelRunner(Identity(), Device(DeviceSpec("cpu")), options)
    start = threading.Barrier(8)

    def client(indices: range) -> list[tuple[int, Future[Completed]]]:
        start.wait(WAIT_S)
        out = []
        for i in indices:
            request = identity_request(i)
            with runner.batcher.arriving():  # as the worker runtime does while decoding
                out.append((i, runner.submit(request)))
        return out

    with started(runner), ThreadPoolExecutor(8) as pool:
        parts = [pool.submit(client, range(t, 200, 8)) for t in range(8)]
        submitted = [pair for part in parts for pair in part.result(WAIT_S)]
        done = {i: future.result(WAIT_S) for i, future in submitted}

    assert sorted(done) == list(range(200))
    grouped = 0
    for i, completed in done.items():
        rows = 1 + i % 3
        by_name = {t.name: t for t in completed.outputs}
        assert list(by_name) == ["x", "label"]
        x = by_name["x"]
        assert x.datatype == "INT64" and x.shape == (rows, 2)
        assert x.value.tolist() == [[i, r] for r in range(rows)], f"request {i} got another's rows"
        label = by_name["label"]
        assert label.datatype == "BYTES" and label.shape == (rows,)
        assert isinstance(label.value, np.ndarray)
        assert label.value.tolist() == [f"{i}/{r}" for r in range(rows)]
        assert rows <= completed.batch_size <= 8
        assert completed.queue_ms >= 0 and completed.compute_ms >= 0
        grouped += completed.batch_size > rows
    assert grouped > 0, "no request was ever batched with another"


# -- (b) poison isolation ----------------------------------------------------------------------


class Hog(Poison):
    """Poison whose forward runs out of host memory: ``MemoryError`` raised without a message."""

    name = "hog"

    def forward(self, batch: Batch) -> Batch:
        raise MemoryError


def test_a_model_error_without_a_message_says_so_instead_of_ending_at_a_colon() -> None:
    runner = runner_for(Hog())
    future = runner.submit(scalar_request("hog-1", 1.0, model="hog"))
    with started(runner):
        error = future.exception(WAIT_S)
    assert isinstance(error, ModelError)
    assert str(error) == "request hog-1: model 'hog' raised MemoryError (no message)"
    assert isinstance(error.__cause__, MemoryError)


class Scripted(Poison):
    """A TorchScript program (a 32 -> 4 linear layer) run on the request's input: a wrong shape
    raises inside TorchScript's interpreter, whose error text holds its trace."""

    name = "scripted"

    def __init__(self) -> None:
        super().__init__()
        self.program = torch.jit.script(torch.nn.Linear(32, 4))

    def forward(self, batch: Batch) -> Batch:
        return {"output": self.program(batch["input"])}


def test_a_torchscript_error_is_one_line_and_its_trace_goes_to_the_log(caplog) -> None:
    runner = runner_for(Scripted())
    future = runner.submit(scalar_request("ts-1", 1.0, model="scripted"))
    with caplog.at_level("WARNING"), started(runner):
        error = future.exception(WAIT_S)
    # The caller hears one line: the model, the error TorchScript raised, where
    assert isinstance(error, ModelError)
    assert str(error) == ("request ts-1: model 'scripted' raised RuntimeError: mat1 and mat2 "
                          "shapes cannot be multiplied (1x1 and 32x4) (in the TorchScript program)")
    # And the worker's log has TorchScript's trace whole
    assert "Traceback of TorchScript" in caplog.text and "model 'scripted' raised" in caplog.text


class Raising(Poison):
    """Raises a plain Python error from its forward, whatever it gets."""

    name = "raising"

    def forward(self, batch: Batch) -> Batch:
        return _deep_in_the_model()


def _deep_in_the_model() -> Batch:
    raise KeyError("weights.layer3")


def test_a_model_error_is_one_line_and_its_trace_is_logged(caplog) -> None:
    runner = runner_for(Raising())
    futures = [runner.submit(scalar_request(f"r-{i}", 1.0, model="raising")) for i in range(3)]
    with caplog.at_level("WARNING"), started(runner):
        errors = [f.exception(WAIT_S) for f in futures]
    assert [str(e) for e in errors] == [f"request r-{i}: model 'raising' raised KeyError: "
                                        f"'weights.layer3'" for i in range(3)]
    # each ran alone once its batch failed: a trace of each run's error, naming where it raised
    traces = [r for r in caplog.records if r.exc_info and "its trace" in r.getMessage()]
    assert [r.getMessage() for r in traces] == [
        "model 'raising' raised KeyError; its trace (the requests it failed each get their one "
        "line):"] * 3
    assert all(r.exc_info[2] is not None and "_deep_in_the_model" in "".join(
        traceback.format_tb(r.exc_info[2])) for r in traces)


def test_the_requests_of_one_error_log_its_trace_once(caplog) -> None:
    try:
        _deep_in_the_model()
    except KeyError as exc:
        shared = exc
    with caplog.at_level("WARNING"):
        errors = [model_failure(f"b-{i}", "m", shared, lambda e: False) for i in range(4)]
    assert [str(e) for e in errors] == [f"request b-{i}: model 'm' raised KeyError: "
                                        f"'weights.layer3'" for i in range(4)]
    traces = [r for r in caplog.records if r.exc_info]
    assert len(traces) == 1 and traces[0].exc_info[1] is shared


def test_a_poisoned_request_fails_alone() -> None:
    # Given: five good requests and one negative one queued before the device starts,
    # so that they form one batch
    model = Recording()
    runner = runner_for(model)
    values = {"good-0": 1.0, "good-1": 2.0, "bad": -1.0, "good-2": 3.0, "good-3": 4.5, "good-4": 0.0}
    futures = {rid: runner.submit(scalar_request(rid, v)) for rid, v in values.items()}
    # When
    with started(runner):
        for future in futures.values():
            future.exception(WAIT_S)
    # Then: the batch ran whole once, then each request alone
    assert model.calls[0] == list(values.values())
    assert sorted(len(c) for c in model.calls[1:]) == [1] * len(values)
    # only the bad request failed, naming itself
    with pytest.raises(ModelError) as info:
        futures["bad"].result()
    assert str(info.value).startswith("request bad: model 'poison' raised RuntimeError")
    assert "negative input" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    for rid, value in values.items():
        if rid != "bad":
            assert only_output(futures[rid].result()).tolist() == [[value * 2]]


def test_a_batch_without_poison_runs_once() -> None:
    model = Recording()
    runner = runner_for(model)
    futures = [runner.submit(scalar_request(f"r{i}", float(i))) for i in range(5)]
    with started(runner):
        results = [only_output(f.result(WAIT_S)).item() for f in futures]
    assert results == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert model.calls == [[0.0, 1.0, 2.0, 3.0, 4.0]]
    assert all(f.result().batch_size == 5 for f in futures)


# -- (c), (d) requests the runner refuses ------------------------------------------------------


def test_more_rows_than_max_batch_size_is_invalid() -> None:
    runner = runner_for(Identity(), max_batch_size=8)
    request = decode_request("too-big", {"model": "identity", "inputs": [
        {"name": "x", "shape": [9, 1], "datatype": "FP32", "data": [0.0] * 9}]})
    with pytest.raises(InvalidRequest) as info:
        runner.submit(request)
    assert str(info.value) == ("request too-big: 9 rows exceed max_batch_size 8 of model 'identity'")
    assert len(runner.batcher) == 0
    # exactly max_batch_size rows is fine
    ok = decode_request("just-fits", {"model": "identity", "inputs": [
        {"name": "x", "shape": [8, 1], "datatype": "FP32", "data": [0.0] * 8}]})
    with started(runner):
        assert runner.submit(ok).result(WAIT_S).outputs[0].shape == (8, 1)


def test_inputs_disagreeing_on_the_batch_dimension_are_invalid() -> None:
    runner = runner_for(Identity())
    request = decode_request("ragged", {"model": "identity", "inputs": [
        {"name": "a", "shape": [2, 1], "datatype": "FP32", "data": [1.0, 2.0]},
        {"name": "b", "shape": [3], "datatype": "INT32", "data": [1, 2, 3]}]})
    with pytest.raises(InvalidRequest) as info:
        runner.submit(request)
    assert str(info.value) == ("request ragged: inputs disagree on the batch dimension ('a': 2, 'b': 3)")
    assert len(runner.batcher) == 0


def test_model_validation_runs_on_submit() -> None:
    runner = runner_for(Poison())
    bad = decode_request("wrong-dt", {"model": "poison", "inputs": [
        {"name": "input", "shape": [1, 1], "datatype": "INT64", "data": [1]}]})
    with pytest.raises(InvalidRequest, match="^request wrong-dt: input 'input': datatype INT64"):
        runner.submit(bad)
    assert len(runner.batcher) == 0


# -- (e) a model that breaks its contract ------------------------------------------------------


def test_wrong_number_of_output_rows_fails_the_whole_batch() -> None:
    runner = runner_for(ExtraRow())
    ids = ["e0", "e1", "e2"]
    futures = {rid: runner.submit(scalar_request(rid, 1.0, model="extra_row")) for rid in ids}
    with started(runner):
        errors = {rid: f.exception(WAIT_S) for rid, f in futures.items()}
    # (the batch fails, then each request fails alone, with its own message)
    for rid, err in errors.items():
        assert isinstance(err, ModelError), err
        assert str(err).startswith(f"request {rid}: ")
        assert "output 'output' has 2 rows for a batch of 1" in str(err)


def test_a_lone_request_with_wrong_output_rows_fails() -> None:
    with started(runner_for(ExtraRow())) as runner:
        err = runner.submit(scalar_request("lone", 1.0, model="extra_row")).exception(WAIT_S)
    assert isinstance(err, ModelError)
    assert "request lone: " in str(err) and "has 2 rows for a batch of 1" in str(err)


# -- (f) shutdown ------------------------------------------------------------------------------


def test_close_fails_queued_requests_and_finishes_the_running_one() -> None:
    # Given: the device is busy with one request, three more wait in the queue
    model = Gate()
    runner = runner_for(model, max_batch_size=1).start()
    running = runner.submit(scalar_request("running", 1.0, model="gate"))
    assert model.entered.wait(WAIT_S)
    queued = {rid: runner.submit(scalar_request(rid, 2.0, model="gate")) for rid in ("q0", "q1", "q2")}
    # When: the runner closes
    closer = threading.Thread(target=runner.close)
    closer.start()
    # Then: the queued requests fail at once, saying why
    for rid, future in queued.items():
        err = future.exception(WAIT_S)
        assert isinstance(err, ModelError)
        assert str(err) == f"request {rid}: worker shut down before model 'gate' ran it"
    # and the request on the device still completes; close returns
    model.release.set()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert only_output(running.result(WAIT_S)).tolist() == [[2.0]]
    assert model.calls == [[1.0]]
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit(scalar_request("late", 1.0, model="gate"))


def test_close_of_an_idle_runner_returns() -> None:
    runner = runner_for(Identity()).start()
    runner.close()
    assert runner._threads and not any(t.is_alive() for t in runner._threads)


def test_close_before_start_fails_queued_requests() -> None:
    runner = runner_for(Identity())
    future = runner.submit(scalar_request("never", 1.0, model="identity"))
    runner.close()
    assert isinstance(future.exception(0), ModelError)


# -- (g) revoked requests ----------------------------------------------------------------------


def test_revoked_requests_never_reach_the_device() -> None:
    model = Recording()
    revoked = {"revoked-1"}
    asked: list[str] = []

    def is_revoked(request_id: str) -> bool:
        asked.append(request_id)
        return request_id in revoked

    runner = runner_for(model, is_revoked=is_revoked)
    futures = {rid: runner.submit(scalar_request(rid, v))
               for rid, v in (("live-0", 1.0), ("revoked-1", 7.0), ("live-2", 3.0))}
    with started(runner):
        with pytest.raises(RequestRevoked) as info:
            futures["revoked-1"].result(WAIT_S)
        live = {rid: only_output(futures[rid].result(WAIT_S)).item() for rid in ("live-0", "live-2")}
    assert "request revoked-1" in str(info.value)
    assert live == {"live-0": 2.0, "live-2": 6.0}
    assert model.calls == [[1.0, 3.0]]  # 7.0 never ran
    # asked when the batch formed and again just before the device: never more than that
    assert set(asked) == {"live-0", "live-2", "revoked-1"} and asked.count("revoked-1") == 1
    assert asked.count("live-0") == 2
    assert futures["live-0"].result().batch_size == 2


def test_a_batch_of_only_revoked_requests_runs_nothing() -> None:
    model = Recording()
    runner = runner_for(model, is_revoked=lambda rid: True)
    future = runner.submit(scalar_request("gone", 1.0))
    with started(runner):
        assert isinstance(future.exception(WAIT_S), RequestRevoked)
        # the device thread is still serving
        runner.is_revoked = lambda rid: False
        assert only_output(runner.submit(scalar_request("next", 2.0)).result(WAIT_S)).item() == 4.0
    assert model.calls == [[2.0]]


class Staged(Model):
    """Each of preprocess, forward and postprocess sleeps ``stage_s`` (the GIL is free meanwhile)."""

    name = "staged"
    stage_s = 0.05

    def __init__(self) -> None:
        self.threads: dict[str, set[str]] = {"pre": set(), "forward": set(), "post": set()}

    def _stage(self, name: str) -> None:
        self.threads[name].add(threading.current_thread().name)
        time.sleep(self.stage_s)

    def preprocess(self, batch: Batch) -> Batch:
        self._stage("pre")
        return {"input": batch["input"] + 1}

    def forward(self, batch: Batch) -> Batch:
        self._stage("forward")
        return {"output": batch["input"] * 10}

    def postprocess(self, outputs: Batch) -> Batch:
        self._stage("post")
        return {"output": outputs["output"] - 1}


@pytest.mark.parametrize("pipelined", [True, False])
def test_stages_run_in_order_and_overlap_when_pipelined(pipelined: bool) -> None:
    # Given a model whose three stages each take 50 ms, and one request per batch
    model = Staged()
    options = ModelOptions(max_batch_size=1, max_delay_ms=0, pipelined=pipelined, warmup=False)
    runner = ModelRunner(model, Device(DeviceSpec("cpu")), options)
    with started(runner):
        futures = [runner.submit(scalar_request(f"s{i}", float(i), model="staged")) for i in range(6)]
        results = [only_output(f.result(WAIT_S)).tolist() for f in futures]
    # Then each request went through preprocess → forward → postprocess, in that order
    assert results == [[[(i + 1) * 10 - 1.0]] for i in range(6)]
    # and the stages ran in three threads when pipelined, one otherwise
    used = set().union(*model.threads.values())
    assert len(used) == (3 if pipelined else 1)


def test_a_model_without_pre_or_postprocess_has_no_prep_thread() -> None:
    runner = runner_for(Identity(), pipelined=True)
    assert [t.name for t in runner._threads] == ["device-identity-0", "post-identity"]


def _finished_in(future: Future[Completed]) -> list[str]:
    """The name of the thread that settles ``future`` (filled when it does)."""
    seen: list[str] = []
    future.add_done_callback(lambda _: seen.append(threading.current_thread().name))
    return seen


def test_a_batch_is_finished_on_the_device_thread_unless_another_waits_for_the_device() -> None:
    model = Gate()
    with started(runner_for(model, max_batch_size=1)) as runner:
        # Given: one request on the device, another waiting for it
        first = runner.submit(scalar_request("first", 1.0, model="gate"))
        first_by = _finished_in(first)
        assert model.entered.wait(WAIT_S)
        second = runner.submit(scalar_request("second", 2.0, model="gate"))
        second_by = _finished_in(second)
        # When: the device finishes both
        model.release.set()
        assert only_output(first.result(WAIT_S)).tolist() == [[2.0]]
        assert only_output(second.result(WAIT_S)).tolist() == [[4.0]]
    # Then: the first, with a batch waiting, was handed to the post thread; the second, with
    # nothing waiting, was finished where it ran
    assert first_by == ["post-gate"] and second_by == ["device-gate-0"]


def test_a_request_past_its_deadline_never_reaches_the_device() -> None:
    from asyncinfer.errors import RequestExpired

    model = Recording()
    with started(runner_for(model)) as runner:
        stale = runner.submit(scalar_request("stale", 5.0), expires_in_s=0.0)
        fresh = runner.submit(scalar_request("fresh", 1.0), expires_in_s=60.0)
        with pytest.raises(RequestExpired, match="request stale: expired before it reached the device"):
            stale.result(WAIT_S)
        assert only_output(fresh.result(WAIT_S)).tolist() == [[2.0]]
    assert model.calls == [[1.0]]


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_batchs_requests_are_settled_inside_one_settling_scope(pipelined: bool) -> None:
    # Given a runner whose batches are settled inside a scope that counts its entries
    scopes: list[list[str]] = []
    inside = threading.local()

    @contextmanager
    def settling() -> Iterator[None]:
        inside.scope = []
        try:
            yield
        finally:
            scopes.append(inside.scope)
            inside.scope = None

    runner = ModelRunner(Identity(), Device(DeviceSpec("cpu")),
                         ModelOptions(max_batch_size=16, max_delay_ms=200, pipelined=pipelined,
                                      warmup=False), hooks=DeviceHooks(settling=settling))
    requests = [scalar_request(f"r{i}", float(i), model="identity") for i in range(8)]
    seen: list[str] = []
    with started(runner):
        futures = []
        with runner.batcher.arriving():  # one batch of the eight, formed once all are in
            for request in requests:
                futures.append(runner.submit(request))
                futures[-1].add_done_callback(
                    lambda f, rid=request.id: (seen.append(rid),
                                               getattr(inside, "scope", None) is not None
                                               and inside.scope.append(rid)))
        for future in futures:
            future.result(WAIT_S)
    # Then the batch's eight requests were all settled inside one scope
    assert sorted(seen) == sorted(r.id for r in requests)
    assert [sorted(s) for s in scopes if s] == [sorted(r.id for r in requests)]


def test_the_batcher_keeps_to_the_devices_cost_ratio() -> None:
    on_cpu = ModelRunner(Identity(), Device(DeviceSpec("cpu")), ModelOptions())
    assert on_cpu.batcher.max_cost_ratio == 1.25
    chosen = ModelRunner(Identity(), Device(DeviceSpec("cpu")), ModelOptions(max_cost_ratio=1.6))
    assert chosen.batcher.max_cost_ratio == 1.6


class _LongHostStages(Staged):
    """Preprocess and postprocess take three times what the device takes."""

    def _stage(self, name: str) -> None:
        self.threads[name].add(threading.current_thread().name)
        time.sleep(self.stage_s if name == "forward" else 3 * self.stage_s)


def test_the_pace_a_runner_reports_is_its_devices_not_its_batches_whole_way() -> None:
    # Given a model whose device stage takes 50 ms and its host stages 150 ms each, batches of one
    model = _LongHostStages()
    options = ModelOptions(max_batch_size=1, max_delay_ms=0, warmup=False)
    runner = ModelRunner(model, Device(DeviceSpec("cpu")), options)
    with started(runner):
        futures = [runner.submit(scalar_request(f"p{i}", float(i), model="staged")) for i in range(4)]
        for f in futures:
            f.result(WAIT_S)
        # Then the pace that sizes what a worker holds (policy/backpressure.py) is the device's
        # time with a batch, not the 300 ms and more from its forming to its results
        assert runner.batch_s is not None and Staged.stage_s <= runner.batch_s < 3 * Staged.stage_s
