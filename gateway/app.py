"""The gateway process: ``create_app(settings)`` and ``lanegate gateway``.

The app holds its state in typed keys (``gateway/state.py``): the settings, one
``redis.asyncio`` client, one ``aiohttp.ClientSession`` and on it the internal
links to the workers, one per worker (``gateway/links.py``; all opened and closed
by ``cleanup_ctx``), and the set of open public WebSockets, which ``on_shutdown``
drains and closes with 1001.

Routes: ``/v1/stream`` (``gateway/stream.py``), ``/v1/transcriptions``
(``gateway/uploads.py``), ``/v1/audio/transcriptions``
(``gateway/openai_compat.py``), ``/healthz``, ``/readyz``, ``/metrics``
(``gateway/health.py``). Every HTTP error is JSON (``gateway/errors.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
from collections.abc import AsyncIterator, Callable

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web

from gateway.auth import auth_enabled
from gateway.errors import error_middleware
from gateway.health import setup_health
from gateway.links import links_ctx
from gateway.state import HTTP, REDIS, SETTINGS, SOCKETS
from gateway.stream import CLOSE_GOING_AWAY, setup_stream
from lanegate import metrics
from lanegate.logs import configure_logging, get_logger
from lanegate.settings import Settings, from_args

log = get_logger("gateway.app")

__all__ = ["HTTP", "REDIS", "SETTINGS", "SOCKETS", "create_app", "main"]

#: Redis client timeouts: connecting fails fast so requests answer 503 while Redis
#: is down; no per-command socket timeout (blocking reads are legitimate).
REDIS_CONNECT_TIMEOUT_S = 2.0
REDIS_HEALTH_CHECK_S = 5


async def _redis_ctx(app: web.Application) -> AsyncIterator[None]:
    client = aioredis.Redis.from_url(
        app[SETTINGS].redis_url,
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
        health_check_interval=REDIS_HEALTH_CHECK_S,
    )
    app[REDIS] = client
    yield
    await client.aclose()


async def _http_ctx(app: web.Application) -> AsyncIterator[None]:
    # One internal WebSocket (link) per worker: aiohttp's default connector caps a
    # session at 100 connections, which would queue the link to worker 101.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    app[HTTP] = session
    yield
    await session.close()


async def _close_sockets(app: web.Application) -> None:
    """Close public WebSockets not drained by their own routes (after the stream drain)."""
    sockets: set[web.WebSocketResponse] = app[SOCKETS]
    for ws in list(sockets):
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.close(code=CLOSE_GOING_AWAY, message=b"gateway shutting down")


def _setup_optional(app: web.Application, module: str, func: str) -> None:
    """Register routes of a module another team member may still be writing."""
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:  # a missing dependency inside it is a real error
            raise
        log.warning("routes_unavailable", module=module, error=str(exc))
        return
    setup: Callable[[web.Application], None] = getattr(imported, func)
    setup(app)


def create_app(settings: Settings) -> web.Application:
    """The gateway application; Redis and the client session open on startup."""
    # uploads stream their bodies (gateway/intake.py); every other body stays under
    # aiohttp's default client_max_size (1 MiB)
    app = web.Application(middlewares=[error_middleware])
    app[SETTINGS] = settings
    sockets: set[web.WebSocketResponse] = set()
    app[SOCKETS] = sockets
    app.cleanup_ctx.append(_redis_ctx)
    app.cleanup_ctx.append(_http_ctx)
    app.cleanup_ctx.append(links_ctx)  # after HTTP: the links close before it
    setup_health(app)
    setup_stream(app)
    _setup_optional(app, "gateway.uploads", "setup_uploads")
    _setup_optional(app, "gateway.openai_compat", "setup_openai")
    app.on_shutdown.append(_close_sockets)
    metrics.init_gateway_series()
    return app


def main(args: argparse.Namespace) -> int:
    """``lanegate gateway``: serve ``create_app`` on ``host:port`` until SIGINT/SIGTERM."""
    settings = from_args(args)
    configure_logging(settings.log_level, process="gateway")
    if not settings.redis_url:
        log.error("no_redis_url", message="set --redis-url or LANEGATE_REDIS_URL "
                  "(`lanegate up` starts its own Redis)")
        return 2
    if not auth_enabled(settings):
        log.warning("auth_off", message="LANEGATE_API_KEYS is empty: every caller is "
                    "accepted as tenant 'anonymous'")
    log.info("gateway_start", host=settings.host, port=settings.port)
    web.run_app(create_app(settings), host=settings.host, port=settings.port,
                print=None, shutdown_timeout=settings.drain_timeout_s + 5.0,
                access_log=None)
    log.info("gateway_stop")
    return 0
