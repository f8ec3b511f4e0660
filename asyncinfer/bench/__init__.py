"""``asyncinfer bench``: asyncinfer against the in-process limit and plain Celery, side by side."""
