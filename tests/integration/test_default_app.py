"""``import asyncinfer`` makes its app Celery's default: Celery's own ``AsyncResult(id).get()``
reads a request's result in any process, with no app passed."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.support.processes import ROOT, worker_env

pytestmark = pytest.mark.timeout(90)

READ = """
import json, sys
import asyncinfer
from celery import current_app
from celery.result import AsyncResult
result = AsyncResult(sys.argv[1])
print(json.dumps({"app": current_app.main, "state": result.state,
                  "data": result.get(timeout=30)["outputs"][0]["data"]}))
"""


def test_celerys_async_result_reads_a_result_after_import_asyncinfer(client, redis_url) -> None:
    future = client.submit("identity", {"x": np.array([[1.5, 2.5]], np.float32)})
    assert future.result(timeout=30)["x"].tolist() == [[1.5, 2.5]]
    done = subprocess.run([sys.executable, "-c", READ, future.id], env=worker_env(redis_url),
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "app": "asyncinfer", "state": "SUCCESS", "data": [1.5, 2.5]}


def test_a_default_app_chosen_before_import_asyncinfer_stays(redis_url) -> None:
    code = ("import celery; mine = celery.Celery('mine'); mine.set_default(); import asyncinfer; "
            "from celery import _state; print(_state.default_app.main)")
    done = subprocess.run([sys.executable, "-c", code], env=worker_env(redis_url), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "mine"
