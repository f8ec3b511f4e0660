"""The asyncinfer app with Celery's prefork pool, as a user's own configuration could ask for it
(the app's configuration names the threads pool, which ``-P prefork`` on the command line does not
override): for the tests that a pool that forks runs no model."""

from asyncinfer.celery_app import app

app.conf.worker_pool = "prefork"

__all__ = ["app"]
