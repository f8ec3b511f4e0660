"""Policy: retries and the retry budget, time limits, the tasks a worker runs."""
