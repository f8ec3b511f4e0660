"""Model control through the gateway (Triton's repository extension: client/model_control.py): the index,
and a load or unload's parameters checked and sent to the fleet — only when the gateway's operator
allows it (Triton's ``--model-control-mode``: ``explicit``; by default, ``none``, a load or unload
is refused and the index is still served)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from asyncinfer import errors
from asyncinfer.client.client import Client
from asyncinfer.client.model_control import DEFAULT_CONTROL_TIMEOUT_S, LOAD, ControlOutcome
from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.wire.envelope import printable

__all__ = ["control_options", "repository_index", "send_control", "check_allowed", "NOT_ALLOWED",
           "EXPLICIT"]

#: The model control mode that lets the gateway load and unload (Triton's name).
EXPLICIT = "explicit"
#: Triton's words when its model control mode refuses a load or unload (tools match on them).
NOT_ALLOWED = "explicit model load / unload is not allowed if polling is enabled"

#: The parameters a load or unload takes (Triton's ``unload_dependents`` is accepted: a model here
#: has no dependents).
_CONTROL_PARAMETERS = {"version", "workers", "devices", "timeout_s", "grace_s",
                       "unload_dependents"}


def check_allowed(mode: str, action: str) -> None:
    """Nothing when ``mode`` (the gateway's ``model_control_mode``) allows a load or unload; else
    GatewayError 400 (gRPC ``UNAVAILABLE``, Triton's code) in Triton's words, then how to allow it."""
    if mode == EXPLICIT:
        return
    raise GatewayError(
        400, f"{NOT_ALLOWED}: this gateway's model control mode is '{mode}', so it refuses a "
             f"repository {action}; its operator allows load and unload by starting it with "
             f"--model-control-mode {EXPLICIT} (or ASYNCINFER_MODEL_CONTROL_MODE={EXPLICIT}; "
             f"`asyncinfer up --model-control-mode {EXPLICIT}`)", grpc_code="UNAVAILABLE")


def control_options(model: str, action: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The workers, timeout and grace of a load or unload's parameters; GatewayError 400 for a
    parameter it does not take (Triton's ``config`` and ``file:`` overrides among them)."""
    where = f"{action} of model '{printable(model, 100)}'"
    if not model:
        raise GatewayError(400, f"{action}: a model name is needed")
    unknown = sorted(k for k in parameters if k not in _CONTROL_PARAMETERS)
    if unknown:
        named = ", ".join(repr(printable(k, 40)) for k in unknown)
        raise GatewayError(400, f"{where}: parameter {named} is not supported (supported: "
                                f"version, workers, devices, timeout_s, grace_s; models are loaded as "
                                f"registered, no config or file override)")
    options: dict[str, Any] = {"timeout_s": DEFAULT_CONTROL_TIMEOUT_S, "grace_s": None}
    version = parameters.get("version", "")
    if isinstance(version, bool) or not isinstance(version, (str, int)) or \
            (str(version) and not str(version).isalnum()):
        raise GatewayError(400, f"{where}: parameter 'version' must be a version (letters and "
                                f"digits), got {version!r:.40}")
    options["version"] = str(version)
    for key, what in (("workers", "worker names"), ("devices", "devices")):
        value = parameters.get(key, "")
        if not isinstance(value, str):
            raise GatewayError(400, f"{where}: parameter '{key}' must be a string of "
                                    f"comma-separated {what}, got {value!r:.60}")
        options[key] = [w.strip() for w in value.split(",") if w.strip()]
    if options["workers"] and options["devices"]:
        raise GatewayError(400, f"{where}: name workers or devices, not both")
    for key in ("timeout_s", "grace_s"):
        value = parameters.get(key)
        if value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = -1.0
        if isinstance(value, bool) or not 0 < number <= 3600:
            raise GatewayError(400, f"{where}: parameter '{key}' must be a number of seconds above "
                                    f"0 and at most 3600, got {value!r:.40}")
        options[key] = number
    return options


async def repository_index(client: Client, ready_only: bool = False) -> list[dict[str, str]]:
    """Triton's repository index: every model the fleet knows or could load, per version."""
    try:
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: client.repository_index(ready_only=ready_only))
    except errors.BrokerUnavailable as exc:
        raise GatewayError(503, str(exc)) from exc


async def send_control(client: Client, action: str, model: str,
                       parameters: Mapping[str, Any]) -> ControlOutcome:
    """Send a load or unload of ``model`` to the fleet (``Service.control_model``, its
    parameters) and wait for the workers' answers; the outcome, whatever it is.

    Raises:
        GatewayError: 400 model control not allowed (the client's settings:
            ``model_control_mode``, the gateway's own), or a parameter the gateway does not take;
            503 the broker unreachable.
    """
    check_allowed(client.settings.model_control_mode, action)
    options = control_options(model, action, parameters)
    try:
        return await asyncio.get_running_loop().run_in_executor(None, lambda: (
            client.load_model(model, version=options["version"],
                              workers=options["workers"], devices=options["devices"],
                              timeout_s=options["timeout_s"]) if action == LOAD else
            client.unload_model(model, version=options["version"],
                                workers=options["workers"], devices=options["devices"],
                                timeout_s=options["timeout_s"], grace_s=options["grace_s"])))
    except errors.BrokerUnavailable as exc:
        raise GatewayError(503, str(exc)) from exc

