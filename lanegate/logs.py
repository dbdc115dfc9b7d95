"""structlog logging shared by every process.

structlog's own convention picks the renderer (``log_format``): ``auto`` (the
default) renders readable, coloured lines when stderr is a terminal and JSON lines
when it is not (a file, a pipe, a log collector); ``console`` and ``json`` force one.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_HANDLER_NAME = "lanegate-log"
LOG_FORMATS = ("auto", "console", "json")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def use_console(fmt: str, stream: Any) -> bool:
    """``auto``: readable lines on a terminal, JSON elsewhere."""
    if fmt == "auto":
        isatty = getattr(stream, "isatty", None)
        return bool(isatty is not None and isatty())
    return fmt == "console"


def _renderers(console: bool, colors: bool) -> list[Any]:
    if console:
        return [structlog.dev.ConsoleRenderer(colors=colors)]
    return [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]


def configure_logging(level: str = "info", fmt: str = "auto", **context: Any) -> None:
    """Log lines on stderr in ``fmt`` (``LOG_FORMATS``); ``context`` (e.g. ``worker=...,
    lane=...``) is bound to every event."""
    numeric = _LEVELS.get(level.lower(), logging.INFO)
    console = use_console(fmt, sys.stderr)
    renderers = _renderers(console, colors=use_console("auto", sys.stderr))
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        # a person reads the time of day; a collector wants the full UTC instant
        structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False) if console
        else structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # Records of the standard library's loggers (aiohttp, asyncio, redis, warnings)
    # become the same lines, with the bound context, instead of plain text.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderers],
    ))
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    # replace only our own handler (others, such as pytest's capture, stay)
    root.handlers[:] = [h for h in root.handlers if h.get_name() != _HANDLER_NAME]
    root.addHandler(handler)
    root.setLevel(numeric)
    logging.captureWarnings(True)
    structlog.configure(
        processors=[*shared, *renderers],
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
