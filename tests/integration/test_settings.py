"""Broker resolution with a real process: a URL published by a server that has exited is ignored.

The rest of the settings' tests are in process: tests/unit/test_settings.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncinfer.config.settings import DEFAULT_BROKER_URL, Settings
from tests.unit.test_settings import publish

pytestmark = pytest.mark.timeout(30)


def dead_pid() -> int:
    """The PID of a child that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    return proc.pid


def test_broker_url_published_by_a_dead_server_is_ignored(tmp_path: Path) -> None:
    publish(tmp_path, "redis://127.0.0.1:7777/0", dead_pid())
    s = Settings.from_env({"ASYNCINFER_STATE_DIR": str(tmp_path)})
    assert s.resolved_broker_url() == DEFAULT_BROKER_URL
