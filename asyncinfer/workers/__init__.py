"""Device workers: device binding, batcher, model runners, start-up and supervision."""
