"""``asyncinfer up --detach`` returns once its workers answer; ``asyncinfer down`` stops it all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncinfer.supervision.processes import pid_alive
from tests.support.processes import ROOT, embedded_up_env

pytestmark = pytest.mark.timeout(180)


def run(env: dict[str, str], *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncinfer", *args], input=stdin,
                          capture_output=True, text=True, timeout=150, cwd=ROOT, env=env)


def test_up_detach_then_down(tmp_path: Path) -> None:
    env = embedded_up_env(tmp_path / "state")
    pid_file = tmp_path / "state" / "up.pid"
    try:
        up = run(env, "up", "--detach", "--devices", "cpu", "--models", "identity")
        assert up.returncode == 0, up.stdout + up.stderr
        assert "running in the background" in up.stdout and "asyncinfer down" in up.stdout
        pid = int(pid_file.read_text())
        assert pid_alive(pid) and oct(pid_file.stat().st_mode & 0o777) == "0o600"
        # once it has returned, every model it serves is in the catalogue
        models = run(env, "models", "--json")
        assert models.returncode == 0, models.stderr[-2000:]
        assert json.loads(models.stdout)["identity"]["ready"] is True
        again = run(env, "up", "--detach", "--devices", "cpu")
        assert again.returncode == 1 and f"already running (pid {pid})" in again.stderr
        out = run(env, "infer", "identity", "--input", "-", "--datatype", "FP32",
                  stdin='{"x": [[1, 2]]}')
        assert out.returncode == 0, out.stderr[-2000:]
        assert '"data":[1.0,2.0]' in out.stdout
        down = run(env, "down")
        assert down.returncode == 0
        assert down.stdout.strip() == f"asyncinfer down: stopped 'asyncinfer up' (pid {pid})"
        assert not pid_alive(pid) and not pid_file.exists()
        assert not (tmp_path / "state" / "redis" / "broker_url").exists()  # its Redis stopped too
        assert run(env, "down").returncode == 1
    finally:
        if pid_file.exists():  # a failed test leaves nothing running
            pid = int(pid_file.read_text())
            if pid_alive(pid):
                os.kill(pid, signal.SIGTERM)
