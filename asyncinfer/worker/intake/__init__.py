"""Taking requests from the broker: the fast consumer (the Redis transport), the atomic take, the
leases, the idle wait, the in-flight account, and Celery's consumer feeding the pipeline."""
