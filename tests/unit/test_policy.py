"""Policy building blocks in process: retry options, time limits, the timer, the retry message.
The retry budget and the publisher (bound, idempotency) on a real Redis:
tests/integration/test_retry_budget_and_publisher.py; policy end to end:
tests/integration/test_policy.py."""

from __future__ import annotations

import json
import random
import threading

import redis
from celery.exceptions import SoftTimeLimitExceeded

from asyncinfer.engine.timer import TimeLimits, Timer
from asyncinfer.errors import InvalidRequest, TransientError, TransientModelError
from asyncinfer.policy.retries import RetryPolicy, is_transient
from asyncinfer.policy.time_limits import time_limits_of
from asyncinfer.wire.envelope import parse_envelope, seconds_until
from asyncinfer.wire.messages import retry_message, task_message
from asyncinfer.worker.requests.taken import TakenMessage

# -- retry options --------------------------------------------------------------------------------


def test_retry_policy_retries_only_transient_failures_within_max_retries() -> None:
    policy = RetryPolicy(max_retries=2)
    transient = TransientModelError("request r: out of memory")
    assert policy.should_retry(transient, 0) and policy.should_retry(transient, 1)
    assert not policy.should_retry(transient, 2)
    assert policy.should_retry(SoftTimeLimitExceeded("slow"), 0)
    assert not policy.should_retry(InvalidRequest("request r: bad shape"), 0)
    assert not policy.should_retry(RuntimeError("model bug"), 0)
    assert not RetryPolicy(autoretry_for=()).should_retry(transient, 0)


def test_device_out_of_memory_is_transient() -> None:
    import torch

    assert is_transient(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_transient(TransientError("try again"))
    assert is_transient(ConnectionError("connection reset")) and is_transient(TimeoutError())
    assert is_transient(redis.ConnectionError("broker went away"))
    assert not is_transient(RuntimeError("shape mismatch"))


def test_backoff_is_exponential_capped_and_jittered() -> None:
    fixed = RetryPolicy(backoff_s=0.5, backoff_max_s=3.0, jitter=False)
    assert [fixed.countdown_s(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    jittered = RetryPolicy(backoff_s=0.5, backoff_max_s=3.0, jitter=True)
    rng = random.Random(7)
    draws = [jittered.countdown_s(2, rng) for _ in range(200)]
    assert all(0.0 <= d <= 2.0 for d in draws)
    assert len({round(d, 6) for d in draws}) > 150  # spread out, not one value
    assert 0.7 < sum(draws) / len(draws) < 1.3   # uniform on [0, 2]: mean 1
    assert RetryPolicy(backoff_s=0).countdown_s(3) == 0.0


def test_retry_policy_reads_celery_task_options() -> None:
    class Options:
        autoretry_for = (TransientError,)
        max_retries = 7
        retry_backoff = True
        retry_backoff_max = 30
        retry_jitter = False

    policy = RetryPolicy.of_task(Options())
    assert policy == RetryPolicy(autoretry_for=(TransientError,), max_retries=7, backoff_s=1.0,
                                 backoff_max_s=30.0, jitter=False)


# -- retry message ----------------------------------------------------------------------------------


def test_retry_message_is_the_same_request_one_retry_later() -> None:
    raw = task_message("asyncinfer.infer", "rid-1", {"model": "m", "inputs": []}, "infer.m")
    d = TakenMessage(raw=raw.encode(), queue="infer.m", received_at=0.0)
    parse_envelope(d)
    again = TakenMessage(raw=retry_message(d, 2.5).encode(), queue="infer.m", received_at=0.0)
    parse_envelope(again)
    assert again.request_id == "rid-1"
    assert again.headers["retries"] == 1
    assert again.tag != d.tag
    left = seconds_until(again.headers["eta"])
    assert left is not None and 0 < left <= 2.5
    assert json.loads(again.raw)["body"] == json.loads(raw)["body"]
    third = TakenMessage(raw=retry_message(again, 0).encode(), queue="infer.m", received_at=0.0)
    parse_envelope(third)
    assert third.headers["retries"] == 2


# -- time limits ------------------------------------------------------------------------------------


def test_time_limits_come_from_the_message_then_the_task_then_the_config() -> None:
    class Task:
        time_limit = 30.0
        soft_time_limit = None

    class Conf:
        task_time_limit = 99.0
        task_soft_time_limit = 10.0

    assert time_limits_of([5, 2], Task(), Conf()) == TimeLimits(soft_s=2.0, hard_s=5.0)
    assert time_limits_of([None, None], Task(), Conf()) == TimeLimits(soft_s=10.0, hard_s=30.0)
    assert time_limits_of(None, None, None) == TimeLimits()
    assert not time_limits_of(None, None, None)


def test_timer_calls_in_time_order() -> None:
    timer = Timer()
    calls: list[str] = []
    done = threading.Event()
    timer.call_later(0.2, lambda: (calls.append("late"), done.set()))
    timer.call_later(0.05, lambda: calls.append("early"))
    timer.call_later(0.0, lambda: calls.append("now"))
    assert done.wait(10)
    assert calls == ["now", "early", "late"]
    timer.close()
