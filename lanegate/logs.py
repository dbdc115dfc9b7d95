"""structlog JSON logging shared by every process."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_HANDLER_NAME = "lanegate-json"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure_logging(level: str = "info", **context: Any) -> None:
    """JSON lines on stderr; ``context`` (e.g. ``worker=..., lane=...``) is bound to every event."""
    numeric = _LEVELS.get(level.lower(), logging.INFO)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # Records of the standard library's loggers (aiohttp, asyncio, redis, warnings)
    # become the same JSON lines, with the bound context, instead of plain text.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
    ))
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    # replace only our own handler (others, such as pytest's capture, stay)
    root.handlers[:] = [h for h in root.handlers if h.get_name() != _HANDLER_NAME]
    root.addHandler(handler)
    root.setLevel(numeric)
    logging.captureWarnings(True)
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if context:
        structlog.contextvars.bind_contextvars(**context)


def get_logger(name: str | None = None, **initial: Any) -> Any:
    logger = structlog.get_logger(name)
    return logger.bind(**initial) if initial else logger
