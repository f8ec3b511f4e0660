"""The Celery tasks of asyncinfer."""
