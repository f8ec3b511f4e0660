"""What a simulated fleet spends: Redis' CPU, commands and bytes (read from Redis itself), which
script costs what, and the CPU of the fleet's processes and of everything else on the host.

- :func:`redis_figures`: the counters now (``INFO cpu``, ``commandstats``, ``stats``, and the
  server's CPU from /proc). Deltas of two readings give CPU and commands per request. In
  ``commandstats`` a script's inner commands are counted under their own names as well as in
  the script's EVALSHA, whose time includes theirs.
- :class:`Meter`: those counters, the CPU of the workers and producers (/proc), the host's busy
  CPU (/proc/stat) and load average, between two moments.
- :class:`CommandLog`: every command with the time Redis took to run it, from the slow log at a
  threshold of 0 µs (drained and reset together several times a second), so that the EVALSHA
  time splits by script; each script named by the SHA-1 of the project's script texts. The slow
  log times the run of a command only: reading, parsing and answering it (the system calls of a
  round trip) are the rest of Redis' CPU. The log costs Redis CPU of its own: figures read
  beside it are not the cost of a request.

Used by ``bench/fleet_sim.py``; standard library and redis-py only.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["redis_figures", "script_names", "Meter", "CommandLog"]

#: The modules whose module-level Lua texts the fleet runs (client, worker, catalogue, budget).
SCRIPT_MODULES = ("asyncinfer.broker.publisher", "asyncinfer.broker.take",
                  "asyncinfer.broker.leases", "asyncinfer.broker.wake",
                  "asyncinfer.broker.store", "asyncinfer.broker.catalogue",
                  "asyncinfer.policy.retry_budget")
#: Commands listed per reading (the rest are summed in ``commands_per_…``).
TOP_COMMANDS = 12
#: The command log's own traffic, left out of what it reports.
_OWN = {b"SLOWLOG", b"MULTI", b"EXEC", b"CONFIG", b"INFO"}


def redis_figures(client: Any, pid: int) -> dict[str, Any]:
    """Redis' counters now: CPU seconds (INFO: process and main thread; /proc: the process),
    calls and µs per command, bytes in and out."""
    from asyncinfer.ops.benchmark.systems import process_cpu_s

    cpu = client.info("cpu")
    stats = client.info("stats")
    commands = client.info("commandstats")
    main = cpu.get("used_cpu_sys_main_thread")
    return {
        "cpu_s": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
        "main_cpu_s": None if main is None else float(main) + float(cpu["used_cpu_user_main_thread"]),
        "proc_cpu_s": process_cpu_s(pid),
        "commands": {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
                     for name, v in commands.items()},
        "net_in": int(stats["total_net_input_bytes"]), "net_out": int(stats["total_net_output_bytes"]),
    }


def _host_busy_s() -> float:
    """CPU seconds all cores of this host spent busy so far (/proc/stat: all but idle, iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class Meter:
    """CPU and Redis counters of the fleet between two moments."""

    def __init__(self, redis_client: Any, redis_pid: int, workers: list[int], producers: list[int]):
        self.redis_client, self.redis_pid = redis_client, redis_pid
        self.workers, self.producers = workers, producers
        self.start = self._now()

    def _now(self) -> dict[str, Any]:
        from asyncinfer.ops.benchmark.host import tree_cpu_s

        return {"t": time.monotonic(), "redis": redis_figures(self.redis_client, self.redis_pid),
                "workers": sum(tree_cpu_s(p) for p in self.workers),
                "producers": sum(tree_cpu_s(p) for p in self.producers),
                "me": time.process_time(), "host": _host_busy_s(), "load": os.getloadavg()}

    def delta(self, requests: int) -> dict[str, Any]:
        """The figures since the start, per request (``requests`` > 0) or per second (0)."""
        end, a = self._now(), self.start
        per = max(1, requests) if requests else None
        seconds = end["t"] - a["t"]
        scale = (1.0 / per) if per else (1.0 / seconds)
        unit = "per_request" if per else "per_s"
        r0, r1 = a["redis"], end["redis"]
        calls: dict[str, tuple[float, float]] = {}
        for name, (n, us) in r1["commands"].items():
            n0, us0 = r0["commands"].get(name, (0, 0))
            if n > n0:
                calls[name] = ((n - n0) * scale, (us - us0) * scale)
        top = sorted(calls.items(), key=lambda kv: -kv[1][1])
        ours = {k: end[k] - a[k] for k in ("workers", "producers", "me")}
        redis_cpu = r1["cpu_s"] - r0["cpu_s"]
        main_cpu = None if r1["main_cpu_s"] is None else r1["main_cpu_s"] - r0["main_cpu_s"]
        others = (end["host"] - a["host"]) - sum(ours.values()) - (r1["proc_cpu_s"] - r0["proc_cpu_s"])
        out: dict[str, Any] = {
            "seconds": round(seconds, 2),
            f"redis_cpu_ms_{unit}": round(redis_cpu * 1e3 * scale, 4),
            f"redis_main_cpu_ms_{unit}": None if main_cpu is None else round(main_cpu * 1e3 * scale, 4),
            f"redis_proc_cpu_ms_{unit}": round((r1["proc_cpu_s"] - r0["proc_cpu_s"]) * 1e3 * scale, 4),
            "redis_cpu_share_of_core": round(redis_cpu / seconds, 3),
            f"commands_{unit}": round(sum(c for c, _ in calls.values()), 2),
            f"top_commands_{unit}": {name: {"calls": round(c, 3), "usec": round(us, 2)}
                                     for name, (c, us) in top[:TOP_COMMANDS]},
            f"net_in_bytes_{unit}": round((r1["net_in"] - r0["net_in"]) * scale),
            f"net_out_bytes_{unit}": round((r1["net_out"] - r0["net_out"]) * scale),
            f"worker_cpu_ms_{unit}": round(ours["workers"] * 1e3 * scale, 4),
            f"producer_cpu_ms_{unit}": round(ours["producers"] * 1e3 * scale, 4),
            "others_cpu_cores": round(max(0.0, others) / seconds, 2),
            "loadavg_start": [round(x, 2) for x in a["load"]],
            "loadavg_end": [round(x, 2) for x in end["load"]],
        }
        return out


def script_names() -> dict[bytes, str]:
    """SHA-1 (hex, as EVALSHA names it) → the name of each script of asyncinfer/broker/scripts/
    (and of any Lua text still held by a module of SCRIPT_MODULES, in a tree from before the
    scripts were files)."""
    names: dict[bytes, str] = {}
    try:
        from asyncinfer.broker.scripts import names as script_files
        from asyncinfer.broker.scripts import script
    except ImportError:
        script_files = None
    if script_files is not None:
        for name in script_files():
            names[hashlib.sha1(script(name).encode()).hexdigest().encode()] = name
    for module_name in SCRIPT_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, value in vars(module).items():
            if isinstance(value, str) and "redis.call" in value and not name.startswith("__"):
                sha = hashlib.sha1(value.encode()).hexdigest().encode()
                names.setdefault(sha, f"{module_name.rsplit('.', 1)[1]}.{name}")
    return names


class CommandLog:
    """Every command Redis runs while it is open, summed by name (EVALSHA by script)."""

    def __init__(self, client: Any, interval_s: float = 0.2) -> None:
        self.client = client
        self.interval_s = interval_s
        self.names = script_names()
        #: µs and calls of the commands clients sent (EVALSHA named by script), and of those
        #: that scripts ran.
        self.top: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.inner: Counter[str] = Counter()
        self.inner_calls: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="command-log", daemon=True)
        self._saved: dict[str, str] = {}

    def __enter__(self) -> CommandLog:
        self._saved = {k: v for k, v in self.client.config_get("slowlog-*").items()}
        self.client.config_set("slowlog-max-len", 100000)
        self.client.slowlog_reset()
        self.client.config_set("slowlog-log-slower-than", 0)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.config_set("slowlog-log-slower-than", self._saved["slowlog-log-slower-than"])
        self._stop.set()
        self._thread.join()
        self._drain()  # before the length goes back: a shorter log drops what it holds
        self.client.config_set("slowlog-max-len", self._saved["slowlog-max-len"])

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._drain()

    def _drain(self) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.slowlog_get(100000)
        pipe.slowlog_reset()
        for entry in pipe.execute()[0]:
            words = entry["command"].split(b" ", 2)
            command = words[0].upper()
            if command in _OWN:
                continue
            if command == b"EVALSHA" and len(words) > 1:
                name = self.names.get(words[1].lower(), "script " + words[1][:8].decode())
            else:
                name = command.decode().lower()
            # a script's own commands come from Redis' script client, whose address is '?:0'
            inner = entry.get("client_address", b"").startswith(b"?")
            (self.inner if inner else self.top)[name] += int(entry["duration"])
            (self.inner_calls if inner else self.calls)[name] += 1

    def per_request(self, requests: int) -> dict[str, Any]:
        """Per request: the µs Redis spent running the commands clients sent (EVALSHA by script,
        its inner commands included) and, apart, those that scripts ran; the costliest first."""
        n = max(1, requests)

        def table(usec: Counter[str], calls: Counter[str]) -> dict[str, dict[str, float]]:
            return {name: {"calls": round(calls[name] / n, 3), "usec": round(us / n, 2)}
                    for name, us in usec.most_common()}

        return {"executed_usec": round(sum(self.top.values()) / n, 2),
                "sent_by_clients": table(self.top, self.calls),
                "run_by_scripts": table(self.inner, self.inner_calls)}
