"""docker-compose.yml: every command is one the CLIs accept, every worker owns the NPU it maps."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.processes import ROOT

COMPOSE = ROOT / "docker-compose.yml"
BROKER_URL = "redis://redis:6379/0"
ASCEND_CONTROL_DEVICES = {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"}
ASCEND_DRIVER_MOUNTS = ("/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi",
                        "/etc/ascend_install.info")
#: Flower's options (flower/options.py), for when flower is not installed here.
FLOWER_OPTIONS = {"port", "address", "unix_socket", "debug", "inspect_timeout", "auth", "basic_auth",
                  "max_workers", "max_tasks", "db", "persistent", "broker_api", "ca_certs",
                  "certfile", "keyfile", "xheaders", "auto_refresh", "purge_offline_workers",
                  "cookie_secret", "conf", "enable_events", "natural_time", "url_prefix"}


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _argv(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return list(command) if isinstance(command, list) else shlex.split(command)


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _parse_asyncinfer(argv: list[str]) -> Any:
    from asyncinfer.ops.cli import build_parser

    assert argv[0] == "asyncinfer"
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit as exc:  # argparse's way of refusing
        pytest.fail(f"asyncinfer refuses {argv}: exit {exc.code}")


def _workers(services: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services.items() if _argv(s)[:2] == ["asyncinfer", "worker"]}


def test_every_asyncinfer_command_parses_with_the_real_cli() -> None:
    services = _compose()["services"]
    commands = [_argv(s) for s in services.values() if "command" in s]
    asyncinfer_commands = [a for a in commands if a[0] == "asyncinfer"]
    assert len(asyncinfer_commands) >= 2
    for argv in asyncinfer_commands:
        args = _parse_asyncinfer(argv)
        assert args.command == "worker" and args.models
    # Every command is asyncinfer's, Flower's or Redis's: nothing else to check
    assert all(a[0] in ("asyncinfer", "celery", "redis-server") for a in commands)


def test_flower_runs_on_our_celery_app_with_flags_flower_has() -> None:
    from celery import Celery

    import asyncinfer

    flower = [a for a in (_argv(s) for s in _compose()["services"].values() if "command" in s)
              if a[0] == "celery"]
    assert len(flower) == 1
    argv = flower[0]
    assert argv[:4] == ["celery", "-A", "asyncinfer", "flower"]
    assert isinstance(asyncinfer.app, Celery)  # what `-A asyncinfer` resolves to
    try:
        from flower.options import default_options
    except ImportError:
        known = FLOWER_OPTIONS.__contains__
    else:
        def known(name: str) -> bool:
            return hasattr(default_options, name)
    for flag in argv[4:]:
        match = re.fullmatch(r"--([a-z_]+)=(.+)", flag)
        assert match is not None, f"flower flag {flag!r} is not --name=value"
        assert known(match.group(1)), f"flower has no option {match.group(1)!r}"


def test_redis_persists_to_a_volume() -> None:
    compose = _compose()
    redis = compose["services"]["redis"]
    argv = _argv(redis)
    assert argv[0] == "redis-server" and _option(argv, "--appendonly") == "yes"
    volume, _, target = next(v for v in redis["volumes"] if v.endswith(":/data")).partition(":")
    assert target == "/data" and volume in compose["volumes"]
    assert redis["healthcheck"]["test"][-1] == "ping"


def test_each_npu_worker_owns_the_one_npu_it_maps() -> None:
    services = _compose()["services"]
    workers = _workers(services)
    assert len(workers) >= 2
    npus: list[int] = []
    for name, service in workers.items():
        argv, env = _argv(service), service["environment"]
        # The broker is the redis service, which must be up first
        assert env["ASYNCINFER_BROKER_URL"] == BROKER_URL
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        # Exactly one NPU of the host, plus Ascend's control devices
        devices = set(service["devices"])
        assert ASCEND_CONTROL_DEVICES <= devices
        npu_nodes = devices - ASCEND_CONTROL_DEVICES
        assert len(npu_nodes) == 1, f"{name} maps {sorted(npu_nodes)}"
        host_npu = int(re.fullmatch(r"/dev/davinci(\d+)", npu_nodes.pop()).group(1))  # type: ignore[union-attr]
        npus.append(host_npu)
        # It is the container's device 0: --device and the visible-device variable agree on it
        device = _option(argv, "--device")
        assert re.fullmatch(r"npu:\d+", device)
        assert env["ASCEND_RT_VISIBLE_DEVICES"] == device.split(":")[1] == "0"
        # And the node name says which NPU of the host it serves
        assert _option(argv, "--hostname").split("@")[0] == f"npu{host_npu}" == name
        # With the host's driver mounted read-only
        mounts = {v.split(":")[1]: v.split(":")[2:] for v in service["volumes"]}
        for path in ASCEND_DRIVER_MOUNTS:
            assert mounts.get(path) == ["ro"], f"{name}: {path} not mounted read-only"
    assert len(set(npus)) == len(npus), f"one NPU mapped into two containers: {npus}"


def test_the_commented_cuda_variant_is_a_valid_worker() -> None:
    # Given the commented block, uncommented
    text = COMPOSE.read_text()
    block = text.split("# --- CUDA variant", 1)[1].split("# --- end of the CUDA variant", 1)[0]
    lines = [line.strip()[2:] for line in block.splitlines() if line.strip().startswith("# ")]
    start = next(i for i, line in enumerate(lines) if re.fullmatch(r"[a-z0-9_-]+:", line))
    services = yaml.safe_load("\n".join(lines[start:]))  # from the service's name on
    # Then it is a worker the CLI accepts, given its GPU through the NVIDIA runtime
    (name, service), = services.items()
    argv = _argv(service)
    args = _parse_asyncinfer(argv)
    assert args.command == "worker" and args.device == "cuda:0"
    gpu = service["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert service["environment"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert _option(argv, "--hostname") == f"cuda{gpu['device_ids'][0]}@%h" == f"{name}@%h"
    assert service["environment"]["ASYNCINFER_BROKER_URL"] == BROKER_URL
    # And its image has no torch_npu, which refuses to load beside a CUDA build of torch
    assert "npu" not in service["build"]["args"]["TORCH_SPEC"] + service["build"]["args"]["EXTRAS"]


def test_the_image_the_services_build_exists() -> None:
    services = _compose()["services"]
    built = [s for s in services.values() if "build" in s]
    assert built and all(s["image"] == "asyncinfer:npu" for s in built)
    dockerfile = (ROOT / built[0]["build"]["context"] / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE" in dockerfile and "flower" in dockerfile
    assert ".venv" in Path(ROOT / ".dockerignore").read_text().splitlines()  # keep the context small
