"""The README's Python example runs as written against a real worker."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support.processes import ROOT, worker_env

pytestmark = pytest.mark.timeout(120)


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- readme-example[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert match, "README.md has no marked Python example"
    return match.group(1)


def test_readme_example_runs(worker, redis_url) -> None:
    code = readme_example()
    assert len(code.strip().splitlines()) <= 12
    out = subprocess.run([sys.executable, "-c", code], env=worker_env(redis_url), cwd=ROOT,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("(2, 4) ")
    assert int(lines[0].split()[-1]) >= 2
    assert lines[1] == "['hello', 'wörld']"
    assert len(lines) == 5
    assert all(len(line.split(" ", 1)[0]) == 36 and line.endswith(" (1, 4)") for line in lines[2:])


def test_readme_triton_example_runs_against_up(tmp_path) -> None:
    """The README's tritonclient script, against `asyncinfer up` (its port the only change)."""
    from tests.support.processes import embedded_up_env, start_up, stop_up
    from tests.support.waiting import wait_for

    text = (ROOT / "README.md").read_text()
    code = re.search(r"<!-- readme-triton-example[^>]*-->\s*```python\n(.*?)```", text, re.S).group(1)
    assert '"localhost:8001"' in code
    env = embedded_up_env(tmp_path / "state")
    code = code.replace('"localhost:8001"', f'"127.0.0.1:{env["ASYNCINFER_GRPC_PORT"]}"')
    log = open(tmp_path / "up.log", "wb")
    up = start_up(env, log, "--models", "mlp")
    try:
        def runs() -> subprocess.CompletedProcess | None:
            out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                                 capture_output=True, text=True, timeout=90)
            return out if out.returncode == 0 and out.stdout.startswith("True") else None

        out = wait_for(runs, 90, "the README's Triton example to run", poll_s=1.0)
        lines = out.stdout.splitlines()
        assert lines[0] == "True [-1, 16]"
        assert lines[1].startswith("(2, 4) ") and int(lines[1].split()[-1]) >= 2
    finally:
        stop_up(up, [])
        log.close()
