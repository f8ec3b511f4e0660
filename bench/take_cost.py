"""What one take script call costs Redis, by messages taken: the fixed cost of a call and the cost
of each message, on its own (no worker, no producer).

    .venv/bin/python bench/take_cost.py [--messages 1,2,8,32] [--calls 3000] [--script FILE]
    CALLGRIND=1 .venv/bin/python bench/take_cost.py --messages 1 --calls 300   # needs valgrind

One real ``redis-server`` (the embedded one); for each count k, ``--calls`` times: k messages of
the sim-fast form pushed (as a producer writes them), then one leased take of them with the
STARTED states, the watch and the four priority lists of a queue, as a batch-1 worker makes it.
Prints Redis' µs per call (``INFO commandstats``) and the inner commands per call. With
``CALLGRIND`` set, Redis runs under valgrind's callgrind, instrumented only while the calls run,
and its dump (``/tmp/take_cost.callgrind.*``) counts the instructions (``callgrind_annotate
--inclusive=yes``). ``--script`` times another take.lua against the same calls. A script, not a
test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import uuid
from pathlib import Path

import redis

from asyncinfer.broker.take import TAKE_SCRIPT, LeaseTerms, StartedText, take_args, take_keys
from asyncinfer.ops.redis_server import RedisServer, redis_server_binary

#: A sim-fast request's body (one row of four FP32), base64 as the client writes it.
BODY = ("W1tdLHsibW9kZWwiOiJzaW0tZmFzdCIsImlucHV0cyI6W3sibmFtZSI6ImlucHV0Iiwic2hhcGUiOlsxLDRdLCJk"
        "YXRhdHlwZSI6IkZQMzIiLCJkYXRhIjpbMC44NTA2MjQyMDM2ODE5NDU4LDAuNjM2OTYxNjM4OTI3NDU5NywwLjUx"
        "MTEzNjQ3MjIyNTE4OTIsMC4yNjk3ODY2NTU5MDI4NjI1NV19XX0seyJjYWxsYmFja3MiOm51bGwsImVycmJhY2tz"
        "IjpudWxsLCJjaGFpbiI6bnVsbCwiY2hvcmQiOm51bGx9XQ==")
LISTS = ["infer.sim-fast", "infer.sim-fast\x06\x163", "infer.sim-fast\x06\x166",
         "infer.sim-fast\x06\x169"]


def message() -> str:
    """One request's kombu envelope, in the form and size the client writes."""
    rid, tag = str(uuid.uuid4()), str(uuid.uuid4())
    headers = {"lang": "py", "task": "asyncinfer.infer", "id": rid, "shadow": None, "eta": None,
               "expires": None, "group": None, "group_index": None, "retries": 0,
               "timelimit": [None, None], "root_id": rid, "parent_id": None, "argsrepr": "()",
               "kwargsrepr": "{'model': 'sim-fast', ...}", "origin": "1@host",
               "ignore_result": False, "replaced_task_nesting": 0, "stamped_headers": None,
               "stamps": {}, "asyncinfer_reply_to": "asyncinfer:reply:" + uuid.uuid4().hex}
    properties = {"correlation_id": rid, "reply_to": "", "delivery_mode": 2,
                  "delivery_info": {"exchange": "", "routing_key": LISTS[0]}, "priority": 0,
                  "body_encoding": "base64", "delivery_tag": tag, "asyncinfer_sent_at": 1.0e9}
    return json.dumps({"body": BODY, "content-encoding": "utf-8",
                       "content-type": "application/json", "headers": headers,
                       "properties": properties}, separators=(",", ":"))


def measure(r: redis.Redis, sha: str, k: int, calls: int, pid: int, callgrind: bool) -> None:
    keys = take_keys(LISTS, watched=[0])
    started = StartedText(key_prefix=b"celery-task-meta-", head='{"status": "STARTED", '
                          '"result": {"pid": 1, "hostname": "w@host"}, "traceback": null, '
                          '"children": [], "date_done": null, "task_id": ', tail="}",
                          expires_s=86400, task="asyncinfer.infer")
    lease = LeaseTerms(10.0, "w@host host 1 1", "asyncinfer:deaths:")
    messages = [message() for _ in range(calls * k)]
    r.set("asyncinfer:watch:" + LISTS[0], "token")
    r.config_resetstat()
    if callgrind:
        subprocess.run(["callgrind_control", "-i", "on", str(pid)], check=True, capture_output=True)
    for j in range(calls):
        r.lpush(LISTS[0], *messages[j * k:(j + 1) * k])
        taken = r.evalsha(sha, len(keys), *keys,
                          *take_args(k + 1, started, lease, "token", [0], 64 << 20))
        assert len(taken) == 1 + 5 * k, taken
    if callgrind:
        subprocess.run(["callgrind_control", f"--dump=take{k}", str(pid)], check=True,
                       capture_output=True)
    stats = r.info("commandstats")
    take = stats["cmdstat_evalsha"]
    inner = {name.removeprefix("cmdstat_"): round(v["calls"] / calls, 2)
             for name, v in stats.items() if name not in ("cmdstat_evalsha", "cmdstat_lpush",
                                                          "cmdstat_config", "cmdstat_set")}
    print(f"take of {k:3d}: {take['usec'] / take['calls']:7.1f} µs a call, "
          f"{take['usec'] / take['calls'] / k:6.1f} µs a message; inner commands a call {inner}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--messages", default="1,2,8,32", help="messages a take takes")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--script", type=Path, help="another take.lua to time")
    args = p.parse_args()
    callgrind = bool(os.environ.get("CALLGRIND"))
    with tempfile.TemporaryDirectory() as tmp:
        binary = None
        if callgrind:
            wrapper = Path(tmp) / "redis-server"
            wrapper.write_text("#!/bin/sh\nexec valgrind --tool=callgrind --instr-atstart=no "
                               "--callgrind-out-file=/tmp/take_cost.callgrind.%p "
                               f"{redis_server_binary()} \"$@\"\n")
            wrapper.chmod(0o755)
            binary = str(wrapper)
        server = RedisServer(Path(tmp) / "redis", appendonly=False, die_with_parent=True,
                             binary=binary).start(timeout_s=120)
        try:
            r = redis.Redis.from_url(server.url)
            sha = r.script_load(args.script.read_text() if args.script else TAKE_SCRIPT)
            pid = server.process.pid  # type: ignore[union-attr]
            for k in (int(n) for n in args.messages.split(",")):
                r.flushall()
                measure(r, sha, k, args.calls, pid, callgrind)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
