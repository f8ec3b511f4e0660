"""``from asyncinfer import Client`` loads no torch: numpy is enough to submit and read results.

Fresh interpreters (a test process has torch loaded already) submit to the session worker and
read its responses, through the Client and through the ``asyncinfer`` command, then say which heavy
modules they loaded. That the numpy codec this rests on gives what the torch one gives (BF16
rounding, datatype inference and casts) is in tests/unit/test_client_light.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import ROOT

pytestmark = pytest.mark.timeout(120)

#: Modules a producer must not pay for.
HEAVY = ("torch", "transformers", "matplotlib", "asyncinfer.models", "asyncinfer.engine",
         "asyncinfer.worker")

LOADED = f"""
def loaded():
    return sorted({{p for p in {HEAVY!r} for m in sys.modules if m == p or m.startswith(p + ".")}})
"""

CLIENT_PRODUCER = r"""
import json, sys
import numpy as np
from asyncinfer import Client
from asyncinfer.wire.payloads import to_input_payload
""" + LOADED + r"""
url, serializer = sys.argv[1], sys.argv[2]
binary = serializer == "msgpack"
with Client(url, serializer=serializer) as client:
    inputs = {"x": np.array([[1.5, -2.0, 3.25]], dtype=np.float32),
              "n": np.array([[7, -8]], dtype=">i4"),
              "words": [["a", "é"]]}
    response = client.submit("identity", inputs).result(timeout=60)
    half = to_input_payload("h", [[0.1, 65504.0]], binary=binary, datatype="BF16")
    halves = client.infer("identity", [half], timeout_s=60)
    out = {"x": response.as_numpy("x").tolist(), "x_dtype": str(response["x"].dtype),
           "n": response["n"].tolist(), "n_dtype": str(response["n"].dtype),
           "words": response["words"].tolist(),
           "h_bits": halves.as_numpy().view(np.uint32).tolist(),
           "h_dtype": str(halves.as_numpy().dtype),
           "loaded": loaded()}
    assert "torch" not in sys.modules, loaded()
    as_torch = response.as_torch("x")  # the one call here that needs torch: it loads it
    out["as_torch"] = [str(as_torch.dtype), as_torch.tolist(), "torch" in sys.modules]
print(json.dumps(out))
"""


def run_python(code: str, *args: str) -> Any:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=90, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("serializer", ["json", "msgpack"])
def test_client_submits_numpy_and_reads_numpy_without_torch(worker: object, redis_url: str,
                                                             serializer: str) -> None:
    # Given a fresh interpreter with only the client imported
    # When it submits numpy arrays, lists and a BF16 payload, and reads the responses as numpy
    doc = run_python(CLIENT_PRODUCER, redis_url, serializer)
    # Then the values come back exactly, and no torch (nor any worker-side module) was loaded
    assert doc["loaded"] == []
    assert (doc["x"], doc["x_dtype"]) == ([[1.5, -2.0, 3.25]], "float32")
    assert (doc["n"], doc["n_dtype"]) == ([[7, -8]], "int32")
    assert doc["words"] == [["a", "é"]]
    # BF16 rounds 0.1 to 0x3DCD and 65504 to 0x4780 (nearest, ties to even); read as float32
    assert (doc["h_bits"], doc["h_dtype"]) == ([[0x3DCD0000, 0x47800000]], "float32")
    # and as_torch() loads torch when it is called, not before
    assert doc["as_torch"] == ["torch.float32", [[1.5, -2.0, 3.25]], True]


CLI_PRODUCER = r"""
import contextlib, io, json, sys
from asyncinfer.ops.cli import main
""" + LOADED + r"""
url, path = sys.argv[1], sys.argv[2]
printed = {}
for name, argv in [("infer", ["infer", "identity", "--input", path]),
                   ("submit", ["submit", "identity", "--input", path, "--request-id", sys.argv[3]]),
                   ("result", ["result", sys.argv[3]]),
                   ("status", ["status"])]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["--broker-url", url, *argv])
    printed[name] = [rc, out.getvalue()]
print(json.dumps({"printed": printed, "loaded": loaded()}))
"""


def test_cli_infer_submit_result_status_load_no_torch(worker: object, redis_url: str,
                                                      tmp_path: Path) -> None:
    # Given an input file of an INT32 list and a fresh interpreter running the command
    path = tmp_path / "input.json"
    path.write_text(json.dumps({"x": [[1, 2, 3]]}))
    request_id = f"light-{tmp_path.name}"
    # When it runs infer, submit, result and status
    doc = run_python(CLI_PRODUCER, redis_url, str(path), request_id)
    printed = doc["printed"]
    # Then each printed what it should, and none of them loaded torch
    assert doc["loaded"] == []
    assert [printed[n][0] for n in ("infer", "submit", "result", "status")] == [0, 0, 0, 0]
    inferred = json.loads(printed["infer"][1])
    assert inferred["outputs"] == [{"name": "x", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 3]}]
    assert printed["submit"][1].strip() == request_id
    result = json.loads(printed["result"][1])
    assert result["id"] == request_id and result["outputs"] == inferred["outputs"]
    assert "test-cpu@" in printed["status"][1]
