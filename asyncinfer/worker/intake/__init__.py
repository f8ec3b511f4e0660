"""Taking requests from the broker and writing their results: the fast consumer, the atomic take,
the idle wait, the result writer and the glue to Celery's stock consumer."""
