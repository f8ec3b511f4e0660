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


def test_down_purge_stops_up_and_removes_what_it_kept(tmp_path: Path) -> None:
    # Given a running `up --detach` whose Redis has written its append-only file
    state = tmp_path / "state"
    env = embedded_up_env(state)
    pid_file = state / "up.pid"
    try:
        up = run(env, "up", "--detach", "--devices", "cpu", "--models", "identity")
        assert up.returncode == 0, up.stdout + up.stderr
        pid = int(pid_file.read_text())
        out = run(env, "infer", "identity", "--input", "-", "--datatype", "FP32",
                  stdin='{"x": [[1, 2]]}')
        assert out.returncode == 0, out.stderr[-2000:]
        assert (state / "redis" / "appendonly.aof").exists() and (state / "up.log").exists()
        # When it is brought down with --purge
        down = run(env, "down", "--purge")
        # Then it stopped, and its state folder is gone: Redis' data, password, log, up's log
        assert down.returncode == 0, down.stderr
        stopped, purged = down.stdout.strip().splitlines()
        assert stopped == f"asyncinfer down: stopped 'asyncinfer up' (pid {pid})"
        assert purged.startswith(f"asyncinfer down: purged {state} (")
        assert purged.endswith(" MB: the embedded Redis' data, log and password, up's log)")
        assert not pid_alive(pid) and not state.exists()
        # and again: nothing left to purge; `down` alone still says nothing runs
        again = run(env, "down", "--purge")
        assert again.returncode == 0
        assert again.stdout.strip() == f"asyncinfer down: nothing to purge ({state} does not exist)"
        assert run(env, "down").returncode == 1
    finally:
        if pid_file.exists():  # a failed test leaves nothing running
            pid = int(pid_file.read_text())
            if pid_alive(pid):
                os.kill(pid, signal.SIGTERM)


def test_down_purge_is_refused_while_up_or_its_redis_still_runs(tmp_path: Path, capsys) -> None:
    from asyncinfer.config.settings import Settings
    from asyncinfer.ops.detach import down, purge_state
    from asyncinfer.ops.up import start_embedded_redis

    state = tmp_path / "state"
    settings = Settings(state_dir=str(state))
    # Given the embedded Redis running in the state folder, as `up` starts it, with no `up`
    redis = start_embedded_redis(settings)
    try:
        out = run(embedded_up_env(state), "down", "--purge")
        # Then --purge is refused, naming it, and its files stay
        assert out.returncode == 1
        assert out.stderr.strip() == (
            f"asyncinfer down: the embedded Redis of 'asyncinfer up' (pid {redis.process.pid}) "
            f"still runs on {state / 'redis'}; stop it first; nothing purged")
        assert (state / "redis" / "password").exists()
    finally:
        redis.stop()
    # Given an `up` (its PID file) that does not stop when asked
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print('ready', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == "ready"
        (state / "up.pid").write_text(str(stubborn.pid))
        capsys.readouterr()
        # When down --purge cannot stop it, or --purge runs while it runs: refused, nothing removed
        assert down(settings, timeout_s=0.5, purge=True) == 1
        assert capsys.readouterr().err.strip() == (
            f"asyncinfer down: 'asyncinfer up' (pid {stubborn.pid}) still runs after 0.5 s; "
            f"nothing purged")
        assert purge_state(settings) == 1
        assert capsys.readouterr().err.strip() == (
            f"asyncinfer down: 'asyncinfer up' (pid {stubborn.pid}) still runs on {state}; "
            f"--purge removes its data only once it has stopped (run `asyncinfer down` first); "
            f"nothing purged")
        assert (state / "redis" / "password").exists() and (state / "up.pid").exists()
    finally:
        stubborn.kill()
        stubborn.wait()
    # Once nothing runs, it purges what up wrote and leaves, naming them, files of others
    (state / "notes.txt").write_text("mine")
    assert down(settings, purge=True) == 0
    said = capsys.readouterr().out.strip()
    assert said.startswith(f"asyncinfer down: purged {state} (") and said.endswith(
        "; left what 'asyncinfer up' did not write there: notes.txt")
    assert sorted(p.name for p in state.iterdir()) == ["notes.txt"]
