"""``asyncinfer up``: embedded Redis with persistence, supervised workers, its gateway, clean stop."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from asyncinfer.client import Client
from asyncinfer.config.published import PID_FILE, published_url
from asyncinfer.config.settings import Settings
from asyncinfer.ops.status import cluster_status
from asyncinfer.supervision.processes import pid_alive
from tests.support.processes import embedded_up_env, start_up, stop_up
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(240)



def _answers(triton: httpclient.InferenceServerClient) -> bool:
    try:
        return bool(triton.is_model_ready("identity"))
    except Exception:  # noqa: BLE001 - not listening yet
        return False


def test_up_serves_restarts_dead_workers_and_stops_cleanly(tmp_path: Path) -> None:
    # Given `asyncinfer up` with no broker configured and a private state folder
    log = open(tmp_path / "up.log", "wb")
    env = embedded_up_env(tmp_path)
    up = start_up(env, log, "--models", "identity", "--concurrency", "4")
    gateway = f"127.0.0.1:{env['ASYNCINFER_HTTP_PORT']}"
    state = tmp_path / "redis"
    client = None
    started: list[int] = []  # every PID `up` started, stopped here by PID whatever happens
    try:
        # Then it starts its embedded Redis and publishes the URL; a client finds it unconfigured
        url = wait_for(lambda: published_url(state), 60, "published broker URL")
        redis_pid = int((state / PID_FILE).read_text())
        started.append(redis_pid)
        client = Client(settings=Settings.from_env(environ={"ASYNCINFER_STATE_DIR": str(tmp_path)}))
        assert client.app.conf.broker_url == url
        first = wait_for(lambda: cluster_status(client.app, 0.5).workers, 90, "a worker")
        started += [w.pid for w in first]
        assert [w.device for w in first] == ["cpu"] and first[0].models == ["identity"]
        one = client.infer("identity", np.array([[1.0]], np.float32), timeout_s=60)
        assert one["input"].tolist() == [[1.0]]
        # and its gateway serves Triton's client
        triton = httpclient.InferenceServerClient(gateway)
        wait_for(lambda: _answers(triton), 60, "up's gateway")
        x = httpclient.InferInput("x", [1, 2], "INT32")
        x.set_data_from_numpy(np.array([[3, 4]], np.int32))
        assert triton.infer("identity", [x]).as_numpy("x").tolist() == [[3, 4]]
        triton.close()

        # When the worker dies, the supervisor starts a new one, which serves
        os.kill(first[0].pid, signal.SIGKILL)
        second = wait_for(lambda: [w for w in cluster_status(client.app, 0.5).workers
                                if w.pid != first[0].pid], 90, "a restarted worker")
        started += [w.pid for w in second]
        two = client.infer("identity", np.array([[2.0]], np.float32), timeout_s=60)
        assert two["input"].tolist() == [[2.0]] and two.parameters["worker"] == second[0].name

        # And Ctrl-C stops everything: workers, Redis, the published URL
        client.close()
        client = None
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        assert not pid_alive(second[0].pid) and not pid_alive(redis_pid)
        with pytest.raises(OSError):  # the gateway stopped with it
            socket.create_connection(("127.0.0.1", int(env["ASYNCINFER_HTTP_PORT"])), timeout=2)
        assert published_url(state) is None
        assert (state / "appendonly.aof").exists(), "the embedded Redis keeps an append-only file"
    finally:
        if client is not None:
            client.close()
        stop_up(up, started)
        log.close()


def test_children_stop_with_up_even_when_it_is_killed(tmp_path: Path) -> None:
    # Given `asyncinfer up` with its embedded Redis and one worker
    log = open(tmp_path / "up.log", "wb")
    up = start_up(embedded_up_env(tmp_path), log, "--models", "identity", "--concurrency", "2")
    state = tmp_path / "redis"
    started: list[int] = []
    try:
        wait_for(lambda: published_url(state), 60, "published broker URL")
        started.append(int((state / PID_FILE).read_text()))
        with Client(settings=Settings.from_env(environ={"ASYNCINFER_STATE_DIR": str(tmp_path)})) as c:
            started += [w.pid for w in wait_for(lambda: cluster_status(c.app, 0.5).workers, 90,
                                                "a worker")]
        # When `up` itself is killed with SIGKILL (no chance to stop anything)
        os.kill(up.pid, signal.SIGKILL)
        up.wait(10)
        # Then its worker and its Redis stop too
        wait_for(lambda: not any(pid_alive(p) for p in started), 60, "the children gone")
    finally:
        stop_up(up, started)
        log.close()
