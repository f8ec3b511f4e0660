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
