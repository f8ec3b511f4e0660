"""Everything that speaks to Redis and kombu: the kombu transport (transport, atomic_take,
kombu_connection), Redis clients for the URLs the settings name (connections, urls, refusals), the
publish and its claims (publisher, celery_claims), the take, the leases, the device marks and the
idle wait (take, leases, device_marks, wake), the store of results and of the response cache, the
catalogue, the fleet statistics and the reply channels, with the Lua scripts they run as files in
``scripts/``. Imports the wire and the base modules, nothing above them."""
