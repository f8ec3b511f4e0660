"""``asyncinfer bench``: asyncinfer against the in-process limit and plain Celery, side by side
(and, from a source checkout, against the peers of its ``bench/peers``: :mod:`.peer_servers`)."""
