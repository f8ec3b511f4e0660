"""What travels: the Open Inference Protocol v2 payloads, their datatypes, the Celery envelope."""
