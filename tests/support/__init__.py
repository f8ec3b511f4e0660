"""What the tests share besides fixtures (those stay in tests/conftest.py): processes, waiting,
Redis databases, metrics, and the test-only models, Celery app and Sentinel group."""
