"""Models that only the tests register (through ASYNCINFER_MODEL_FACTORIES, see processes.py)."""

from __future__ import annotations

import json
import os
import time

import redis
import torch

from asyncinfer.broker.connections import redis_client
from asyncinfer.config.model_options import ModelOptions
from asyncinfer.models.base import Batch, InputSpec, Model
from tests.support.marks import mark_forward, marks_client


class Sleep(Model):
    """``input`` FP32 [n, 1]: sleeps the batch's largest value in seconds, returns the input.

    Marks each batch it starts (marks.py) when ``FORWARD_MARKS_URL`` is set.
    """

    name = "sleep"
    #: Its forward has side effects the tests count: no warm-up batches.
    options = ModelOptions(warmup=False)
    inputs = {"input": InputSpec(("FP32",), (1,))}
    marks: redis.Redis | None = None

    def __init__(self) -> None:
        self.marks = marks_client()

    def forward(self, batch: Batch) -> Batch:
        mark_forward(self.marks, "sleep", batch["input"].reshape(-1).tolist())
        time.sleep(float(batch["input"].max()) if len(batch["input"]) else 0.0)
        return {"output": batch["input"]}


class Poison(Model):
    """``input`` FP32 [n, 1] → ``output`` = input × 2; raises when any row is negative.

    A row ≥ 100 makes the batch first sleep (value − 100) seconds: a way to keep the device busy.
    Marks each batch it starts (marks.py) when ``FORWARD_MARKS_URL`` is set.
    """

    name = "poison"
    #: Its forward has side effects the tests count: no warm-up batches.
    options = ModelOptions(warmup=False)
    inputs = {"input": InputSpec(("FP32",), (1,))}
    marks: redis.Redis | None = None

    def __init__(self) -> None:
        self.marks = marks_client()

    def forward(self, batch: Batch) -> Batch:
        x = batch["input"]
        mark_forward(self.marks, "poison", x.reshape(-1).tolist())
        if len(x) and float(x.max()) >= 100:
            time.sleep(float(x.max()) - 100)
        if bool((x < 0).any()):
            raise RuntimeError("negative input poisons this model")
        return {"output": x * 2}


def make_affine() -> Model:
    """A user factory: ``x`` FP64 [n, 3] → ``y`` = 3x + 1."""

    class Affine(Model):
        inputs = {"x": InputSpec(("FP64",), (3,))}

        def forward(self, batch: Batch) -> Batch:
            return {"y": batch["x"] * 3 + 1}

    return Affine()


class Tripwire:
    """Unpickling this creates the file ``path``: proof that something was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        return (open, (self.path, "w"))


def tiny_linear_module() -> torch.nn.Module:
    """A fixed module the file-model tests save as TorchScript and torch.export programs."""
    torch.manual_seed(1)
    return torch.nn.Linear(4, 2).eval()


class Affine3(Model):
    """``input`` FP32 [n, 1] in three stages: preprocess +1, forward ×10, postprocess −1."""

    name = "affine3"
    inputs = {"input": InputSpec(("FP32",), (1,))}
    forward_inputs = {"prepared": InputSpec(("FP32",), (1,), allow_nonfinite=False)}

    def preprocess(self, batch: Batch) -> Batch:
        return {"prepared": batch["input"] + 1}

    def forward(self, batch: Batch) -> Batch:
        if bool((batch["prepared"] > 1000).any()):
            raise RuntimeError("affine3 refuses values over 999")
        return {"scaled": batch["prepared"] * 10}

    def postprocess(self, outputs: Batch) -> Batch:
        return {"output": outputs["scaled"] - 1}


class Gated(Model):
    """``index`` FP64 [n, 1] → ``output`` = index; counts each row's execution in Redis.

    With ``GATED_REDIS_URL`` set, a batch first waits while ``<GATED_PREFIX>:gate`` is ``closed``
    (setting ``<prefix>:blocked`` while it waits), then adds 1 per row to the hash
    ``<prefix>:executions`` under the row's index: how a test sees which requests ran, how often.
    """

    name = "gated"
    #: Its forward has side effects the tests count: no warm-up batches.
    options = ModelOptions(warmup=False)
    inputs = {"index": InputSpec(("FP64",), (1,))}

    def __init__(self) -> None:
        url = os.environ.get("GATED_REDIS_URL")
        self.prefix = os.environ.get("GATED_PREFIX", "gated")
        self.redis = redis_client(url) if url else None

    def forward(self, batch: Batch) -> Batch:
        index = batch["index"]
        if self.redis is not None:
            while self.redis.get(f"{self.prefix}:gate") == b"closed":
                self.redis.set(f"{self.prefix}:blocked", 1)
                time.sleep(0.02)
            pipe = self.redis.pipeline(transaction=False)
            for i in index.reshape(-1).tolist():
                pipe.hincrby(f"{self.prefix}:executions", str(int(i)), 1)
            pipe.execute()
        return {"output": index}


class Flaky(Model):
    """``input`` FP64 [1, 2] = (index, failures) → ``output`` = input; fails ``failures`` times.

    Every execution appends its time to the Redis list ``<FLAKY_PREFIX>:runs:<index>`` (at
    ``FLAKY_REDIS_URL``), then raises TransientError while the request has run at most
    ``failures`` times; ``failures`` < 0 raises a (non-transient) RuntimeError every time.
    Not batchable: each request is one execution.
    """

    name = "flaky"
    #: Its forward has side effects the tests count: no warm-up batches.
    options = ModelOptions(warmup=False)
    batchable = False
    inputs = {"input": InputSpec(("FP64",), (2,))}

    def __init__(self) -> None:
        url = os.environ.get("FLAKY_REDIS_URL")
        self.redis = redis_client(url) if url else None
        self.prefix = os.environ.get("FLAKY_PREFIX", "flaky")

    def forward(self, batch: Batch) -> Batch:
        from asyncinfer.errors import TransientError

        if self.redis is None:
            raise RuntimeError("flaky needs FLAKY_REDIS_URL")
        index, failures = (int(v) for v in batch["input"][0].tolist())
        runs = int(self.redis.rpush(f"{self.prefix}:runs:{index}", repr(time.time())))
        if failures < 0:
            raise RuntimeError(f"flaky row {index} always fails")
        if runs <= failures:
            raise TransientError(f"flaky row {index}: failure {runs} of {failures}")
        return {"output": batch["input"]}


class Broken(Model):
    """A model whose ``load`` raises: a worker hosting it cannot start."""

    name = "broken"
    inputs = {"input": InputSpec(("FP32",), (1,))}

    def load(self, device: torch.device) -> None:
        raise OSError("weights file is truncated")

    def forward(self, batch: Batch) -> Batch:
        return {"output": batch["input"]}


class Crashy(Model):
    """``index`` FP64 [n, 1] → ``output`` = index; counts each row's starts on the device.

    With ``CRASHY_REDIS_URL`` set, each batch first adds 1 per row to the hash
    ``<CRASHY_PREFIX>:starts`` and appends its rows to the list ``<prefix>:batches``; then a row of
    -1 ends the process at once (``os._exit``: a segfault or a device abort, as far as the worker
    can tell); else the batch sleeps ``CRASHY_SLEEP_S`` seconds (a slow kernel, GIL released;
    none once the key ``<prefix>:fast`` exists), or value − 1000 seconds for a row ≥ 1000. A row
    of -2 ends the process the moment the forward starts, with no round trip first (its batch's
    rows are appended, as a JSON line, to the file ``CRASHY_CRASH_LOG`` names, if any).
    """

    name = "crashy"
    #: Its forward has side effects the tests count: no warm-up batches.
    options = ModelOptions(warmup=False, max_batch_size=8, max_delay_ms=50)
    inputs = {"index": InputSpec(("FP64",), (1,))}

    def __init__(self) -> None:
        url = os.environ.get("CRASHY_REDIS_URL")
        self.prefix = os.environ.get("CRASHY_PREFIX", "crashy")
        self.sleep_s = float(os.environ.get("CRASHY_SLEEP_S", "0"))
        self.crash_log = os.environ.get("CRASHY_CRASH_LOG", "")
        self.redis = redis_client(url) if url else None

    def forward(self, batch: Batch) -> Batch:
        rows = [int(v) for v in batch["index"].reshape(-1).tolist()]
        if -2 in rows:  # the process ends the moment its kernel starts (noted in a file first)
            if self.crash_log:
                fd = os.open(self.crash_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.write(fd, (json.dumps(rows) + "\n").encode())
            os._exit(86)
        if self.redis is not None:
            pipe = self.redis.pipeline(transaction=False)
            for i in rows:
                pipe.hincrby(f"{self.prefix}:starts", str(i), 1)
            pipe.rpush(f"{self.prefix}:batches", json.dumps(rows))
            pipe.execute()
        if -1 in rows:
            os._exit(86)
        longest = max((i - 1000 for i in rows if i >= 1000), default=0)
        fast = self.redis is not None and self.redis.exists(f"{self.prefix}:fast")
        time.sleep(max(0.0 if fast else self.sleep_s, float(longest)))
        return {"output": batch["index"]}


class ChannelMeans(Model):
    """``pixels`` FP32 [n, 3, 2, 2], declared NCHW (Triton's input ``format``) → ``means`` FP32
    [n, 3], each channel's mean."""

    name = "channel-means"
    options = ModelOptions(warmup=False)
    inputs = {"pixels": InputSpec(("FP32",), (3, 2, 2), format="NCHW")}

    def forward(self, batch: Batch) -> Batch:
        return {"means": batch["pixels"].float().mean(dim=(2, 3))}
