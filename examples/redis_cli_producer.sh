#!/usr/bin/env bash
# A producer with nothing but redis-cli: push one asyncinfer.infer request onto queue infer.identity
# (the message Celery's Redis transport expects), then read the v2 response under the request ID.
# Usage: REDIS_PORT=6379 examples/redis_cli_producer.sh
set -euo pipefail
REDIS_CLI=${REDIS_CLI:-redis-cli}
HOST=${REDIS_HOST:-127.0.0.1}
PORT=${REDIS_PORT:-6379}
ID=${REQUEST_ID:-$(cat /proc/sys/kernel/random/uuid)}

# The body: [args, kwargs, embed]; the kwargs are the Open Inference Protocol v2 request.
BODY=$(printf '%s' '[[], {"model": "identity", "inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1.5, 2, 3]}]}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]' | base64 | tr -d '\n')

MESSAGE=$(cat <<JSON
{"body": "$BODY", "content-encoding": "utf-8", "content-type": "application/json",
 "headers": {"lang": "py", "task": "asyncinfer.infer", "id": "$ID", "root_id": "$ID",
             "parent_id": null, "group": null},
 "properties": {"correlation_id": "$ID", "reply_to": "", "delivery_mode": 2,
                "delivery_info": {"exchange": "", "routing_key": "infer.identity"},
                "priority": 0, "body_encoding": "base64", "delivery_tag": "$ID"}}
JSON
)
"$REDIS_CLI" -h "$HOST" -p "$PORT" LPUSH infer.identity "$MESSAGE" >/dev/null
echo "request $ID sent" >&2

# The result backend stores {"status": ..., "result": <v2 response>, ...} under celery-task-meta-<ID>.
for _ in $(seq 300); do
  RESULT=$("$REDIS_CLI" -h "$HOST" -p "$PORT" GET "celery-task-meta-$ID")
  case "$RESULT" in
    *'"status": "SUCCESS"'*|*'"status": "FAILURE"'*) echo "$RESULT"; exit 0 ;;
  esac
  sleep 0.1
done
echo "no result for $ID" >&2
exit 1
