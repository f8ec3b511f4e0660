"""The project's kombu Redis transport passes kombu's own tests of kombu's Redis transport (those of
the kombu release the project is tested with), so that it stays a faithful kombu transport."""

from __future__ import annotations

import re
import subprocess
import sys

import kombu
import pytest

from tests.kombu_upstream import KOMBU_VERSION
from tests.support.processes import ROOT

pytestmark = pytest.mark.timeout(600)


def test_kombus_redis_transport_tests_pass_on_the_projects_transport() -> None:
    if kombu.__version__ != KOMBU_VERSION:
        pytest.skip(f"kombu {kombu.__version__} is installed; tests/kombu_upstream holds "
                    f"kombu {KOMBU_VERSION}'s tests")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/kombu_upstream/kombu_test_redis.py",
         "-p", "tests.kombu_upstream.shim", "-p", "no:cacheprovider", "-o", "addopts=",
         "-o", "python_classes=test_*", "--timeout", "300"],  # kombu's setup.cfg: test_* classes
        cwd=ROOT, capture_output=True, text=True, timeout=540)
    out = run.stdout + run.stderr
    assert "on asyncinfer.broker.transport.Channel, asyncinfer.broker.transport.Transport" in out, out[-3000:]
    assert run.returncode == 0, out[-6000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 300 and " failed" not in out, out[-3000:]
