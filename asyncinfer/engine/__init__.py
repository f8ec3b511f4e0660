"""The engine: device binding, batcher, model runners, timer. Imports neither Celery nor Redis.

Imported before torch in a worker process: OpenMP threads that spin between operations take the
CPU that the serving threads need (measured: half the mlp throughput on a 2-core host), so
unless the user chose otherwise they wait passively.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
