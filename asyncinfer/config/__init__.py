"""Settings (environment and CLI flags → typed values) and the Celery configuration derived from them."""

from asyncinfer.config.celery_config import celery_config
from asyncinfer.config.settings import Settings
from asyncinfer.config.settings_report import settings_table

__all__ = ["Settings", "celery_config", "settings_table"]
