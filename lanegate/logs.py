"""structlog logging shared by every process.

structlog's own convention picks the renderer (``log_format``): ``auto`` (the
default) renders readable, coloured lines when stderr is a terminal and JSON lines
when it is not (a file, a pipe, a log collector); ``console`` and ``json`` force one.

A server process's output never stops it (``guard_output``, called first by ``lanegate
up``, ``gateway``, ``worker`` and the death watch). Its stdout and stderr become
``Outlet``s: a log reader that goes away (``lanegate up | head``, a log shipper that
restarts) turns that output into ``/dev/null`` at the first failed write (EPIPE, or
EIO from a terminal that hung up), so the lines are dropped and the process serves
on; a reader that stops reading (a full pipe, a paused terminal) gets the lines
through one writer thread, so no event loop or signal handler waits on it: the lines
queue (``OUTLET_LINES``) and the newest are dropped past that, with one
``log_lines_dropped`` line once it reads again. A regular file (a ``Child.log``) is
written directly, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import io
import logging
import os
import queue
import stat
import sys
import threading
import time
from typing import Any, TextIO, cast

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


# --- output that never stops the process ----------------------------------------------

#: lines held for a log reader that is not reading; past that the newest are dropped
OUTLET_LINES = 10_000
#: how long ``flush`` waits for its lines to go out before treating the reader as stuck
#: (then ``flush`` returns at once until a write goes through again)
OUTLET_STUCK_S = 0.1
#: at exit, how long the lines still held may take to go out
OUTLET_EXIT_S = 1.0
#: errors of a reader that is gone for good: its output becomes /dev/null
_READER_GONE = (errno.EPIPE, errno.EIO, errno.EBADF, errno.ECONNRESET)


class _Writer:
    """The one thread that writes a process's queued lines to pipes and terminals."""

    def __init__(self) -> None:
        self.lines: queue.Queue[tuple[int, bytes]] = queue.Queue(OUTLET_LINES)
        self.dropped = 0
        self.stuck = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lanegate-output", daemon=True)
        self._thread.start()

    def put(self, fd: int, data: bytes) -> None:
        try:
            self.lines.put_nowait((fd, data))
        except queue.Full:
            with self._lock:
                self.dropped += 1

    def wait(self, timeout_s: float) -> None:
        """Until every queued line is written, at most ``timeout_s``, and not at all
        while the reader is stuck or on the writer's own thread."""
        if self.stuck or threading.current_thread() is self._thread:
            return
        deadline = time.monotonic() + timeout_s
        with self.lines.all_tasks_done:  # Queue.join with a deadline
            while self.lines.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stuck = True
                    return
                self.lines.all_tasks_done.wait(left)

    def _run(self) -> None:
        while True:
            fd, data = self.lines.get()
            try:
                if write_all(fd, data):
                    self.stuck = False
                    self._report_drops()
            finally:
                self.lines.task_done()

    def _report_drops(self) -> None:
        """One line counting the lines dropped, once the held ones are out (sooner, it
        would find the queue full and be dropped itself)."""
        if not self.dropped or not self.lines.empty():
            return
        with self._lock:
            dropped, self.dropped = self.dropped, 0
        if dropped:
            get_logger("lanegate.logs").warning(
                "log_lines_dropped", count=dropped,
                reason=f"the log output was not read for a while ({OUTLET_LINES} lines held)")


def write_all(fd: int, data: bytes) -> bool:
    """Write ``data`` to ``fd``; False if it could not be. A reader gone for good turns
    ``fd`` into /dev/null (later writes, a child's included, go nowhere)."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        if exc.errno in _READER_GONE:
            with contextlib.suppress(OSError):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)
        return False
    return True


class Outlet(io.TextIOBase):
    """stdout or stderr of a server process: whole lines, written so that the process
    never waits long on its reader and never dies of it (see the module's words)."""

    encoding: str = "utf-8"
    errors: str = "backslashreplace"

    def __init__(self, stream: TextIO, writer: _Writer) -> None:
        super().__init__()
        self._fd = stream.fileno()
        self.encoding = stream.encoding or "utf-8"
        mode = os.fstat(self._fd).st_mode
        self._tty = os.isatty(self._fd)
        #: a pipe, socket or terminal can block; a file or /dev/null is written directly
        self._queued = self._tty or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
        self._writer = writer
        self._pending = ""
        self._lock = threading.Lock()

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return self._tty

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            if "\n" not in self._pending:
                return len(text)
            lines, _, self._pending = self._pending.rpartition("\n")
            self._send(lines + "\n")
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._send(self._pending)
                self._pending = ""
        if self._queued:
            self._writer.wait(OUTLET_STUCK_S)

    def _send(self, text: str) -> None:
        data = text.encode(self.encoding, self.errors)
        if self._queued:
            self._writer.put(self._fd, data)
        else:
            write_all(self._fd, data)


_outlets: list[Outlet] = []


def guard_output() -> None:
    """Make this process's stdout and stderr ``Outlet``s (once; before logging is
    configured, which then writes to them)."""
    if _outlets:
        return
    writer = _Writer()
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            outlet = Outlet(stream, writer)
        except (AttributeError, OSError, ValueError):  # no real file behind it
            continue
        _outlets.append(outlet)
        setattr(sys, name, cast(TextIO, outlet))

    def drain() -> None:
        for outlet in _outlets:
            with contextlib.suppress(Exception):
                outlet.flush()
        writer.wait(OUTLET_EXIT_S)

    atexit.register(drain)
