"""The service's logging: the uvicorn log config of ``wds-transform serve`` and the foreseen-abort filter.

``serve_log_config`` is uvicorn's own config (each handler masking the ETL secret, ``redact``) plus
the root logger in the pod's line format at ``ETL_LOG_LEVEL``, where the service's own loggers
(``transformer.*``) write. ``quiet_foreseen_aborts`` leaves the ASGI server's traceback of a response
cut on purpose out of its error log (the job logged the failure as one line).
"""

from __future__ import annotations

import logging

from ..errors import StreamAborted
from ..redact import uvicorn_log_config

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ForeseenAbortFilter(logging.Filter):
    """Leaves out the ASGI server's record of a foreseen ``StreamAborted`` (on uvicorn's error logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, StreamAborted) and error.foreseen)


def quiet_foreseen_aborts(logger: logging.Logger) -> None:
    """``ForeseenAbortFilter`` on ``logger``, once."""
    if not any(isinstance(f, ForeseenAbortFilter) for f in logger.filters):
        logger.addFilter(ForeseenAbortFilter())


def serve_log_config(log_level: str) -> dict:
    """uvicorn's log config (secret-masking handlers) plus the root logger: stderr, ``LOG_FORMAT``, ``log_level``."""
    config = uvicorn_log_config()
    config.setdefault("formatters", {})["service"] = {"format": LOG_FORMAT}
    config.setdefault("handlers", {})["service"] = {
        "class": "logging.StreamHandler", "formatter": "service", "stream": "ext://sys.stderr", "filters": ["redact"]}
    config["root"] = {"level": log_level.upper(), "handlers": ["service"]}
    return config
