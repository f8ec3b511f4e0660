"""The device worker's output side: how each request ends (outcomes), and the writer that stores
results and acknowledges their messages in one round trip per batch (result_writer; the store's
script is broker/store.py)."""
