"""The device worker, as one object (worker.py) with its start-up and launch, its runtime, metrics,
events and request lifecycle as loose modules; ``consumers/`` feed its pipeline (pipeline.py),
``output/`` ends each request and writes its result, ``requests/`` holds what it took."""

import asyncinfer.engine  # noqa: F401 - sets OpenMP's wait policy before torch loads
