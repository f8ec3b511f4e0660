"""What feeds a device worker's pipeline: the fast consumer (the atomic take from Redis), the kombu
intake (Celery's own consumer, on RabbitMQ or when asked), and what both are made of."""
