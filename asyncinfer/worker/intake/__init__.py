"""Taking requests from the broker: the fast consumer (the Redis transport), the atomic take, the
leases, the idle wait, the in-flight account, and the glue to Celery's stock consumer."""
