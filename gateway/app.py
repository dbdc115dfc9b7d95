"""The gateway process: ``create_app(settings)`` and ``lanegate gateway``.

The app holds its state in typed keys (``gateway/state.py``): the settings, one
``redis.asyncio`` client and the job store on it, one ``aiohttp.ClientSession``
and on it the internal links to the workers, one per worker (``gateway/links.py``;
all opened and closed by ``cleanup_ctx``), and the sets of live streams and open
public WebSockets, which ``on_shutdown`` drains and closes with 1001.

Routes: ``/v1/stream`` (``gateway/stream.py``), ``/v1/transcriptions``
(``gateway/uploads.py``), ``/v1/audio/transcriptions``
(``gateway/openai_compat.py``), ``/healthz``, ``/readyz``, ``/metrics``
(``gateway/health.py``). Every HTTP error is JSON (``gateway/errors.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import aiohttp
from aiohttp import WSCloseCode, web

from gateway.auth import auth_enabled, leases_ctx
from gateway.deepgram import setup_deepgram
from gateway.errors import error_middleware
from gateway.health import setup_health
from gateway.links import links_ctx
from gateway.openai_compat import setup_openai
from gateway.openapi import setup_openapi
from gateway.page import setup_page
from gateway.realtime_api import setup_realtime_api
from gateway.state import GATEWAY_ID, HTTP, JOBS, REDIS, SETTINGS, SOCKETS, UPLOAD_POOL
from gateway.status import setup_status
from gateway.stream import setup_stream
from gateway.uploads import setup_uploads
from gateway.wyoming import setup_wyoming
from lanegate import metrics
from lanegate.addresses import is_loopback_host
from lanegate.logs import configure_logging, get_logger
from lanegate.loops import new_loop
from lanegate.redis_io import redis_client
from lanegate.settings import Settings, from_args
from lanes.jobs import JobStore

log = get_logger("gateway.app")

__all__ = ["HTTP", "REDIS", "SETTINGS", "SOCKETS", "create_app", "main"]

async def _redis_ctx(app: web.Application) -> AsyncIterator[None]:
    # no per-command socket timeout: the gateway's blocking reads are legitimate
    client = redis_client(app[SETTINGS].redis_url, socket_timeout=None)
    app[REDIS] = client
    yield
    await client.aclose()


async def _jobs_ctx(app: web.Application) -> AsyncIterator[None]:
    app[JOBS] = JobStore(app[REDIS], app[SETTINGS])
    yield


async def _http_ctx(app: web.Application) -> AsyncIterator[None]:
    # One internal WebSocket (link) per worker: aiohttp's default connector caps a
    # session at 100 connections, which would queue the link to worker 101.
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    app[HTTP] = session
    yield
    await session.close()


async def _upload_pool_ctx(app: web.Application) -> AsyncIterator[None]:
    # its own bounded pool: six long decodes must not take the default executor's
    # threads (DNS lookups, other to_thread work) from live streams
    pool = ThreadPoolExecutor(max_workers=max(1, app[SETTINGS].upload_threads),
                              thread_name_prefix="lanegate-upload")
    app[UPLOAD_POOL] = pool
    yield
    pool.shutdown(wait=False, cancel_futures=True)


async def _close_sockets(app: web.Application) -> None:
    """Close public WebSockets not drained by their own routes (after the stream drain)."""
    sockets: set[web.WebSocketResponse] = app[SOCKETS]
    for ws in list(sockets):
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"gateway shutting down")


def create_app(settings: Settings) -> web.Application:
    """The gateway application; Redis and the client session open on startup."""
    # uploads stream their bodies (gateway/intake.py); every other body stays under
    # aiohttp's default client_max_size (1 MiB)
    app = web.Application(middlewares=[error_middleware])
    app[SETTINGS] = settings
    app[GATEWAY_ID] = uuid.uuid4().hex[:16]
    sockets: set[web.WebSocketResponse] = set()
    app[SOCKETS] = sockets
    app.cleanup_ctx.append(_redis_ctx)
    app.cleanup_ctx.append(_jobs_ctx)  # after Redis: the store is built on its client
    app.cleanup_ctx.append(leases_ctx)  # the sessions' leases hang on its heartbeat
    app.cleanup_ctx.append(_http_ctx)
    app.cleanup_ctx.append(_upload_pool_ctx)
    app.cleanup_ctx.append(links_ctx)  # after HTTP: the links close before it
    setup_health(app)
    setup_wyoming(app)  # its cleanup after the links'; its drain begins with the streams'
    setup_stream(app)
    setup_realtime_api(app)
    setup_deepgram(app)
    setup_uploads(app)
    setup_openai(app)
    setup_page(app)
    setup_openapi(app)
    setup_status(app)
    app.on_shutdown.append(_close_sockets)
    metrics.init_gateway_series()
    return app


def anonymous_refusal(settings: Settings) -> str | None:
    """Why the gateway must not start with these settings (auth off on an address
    others can reach, without ``allow_anonymous``), or None."""
    if auth_enabled(settings) or settings.allow_anonymous or is_loopback_host(settings.host):
        return None
    return (f"refusing to serve without API keys on {settings.host!r}, which is not a "
            "loopback address: set LANEGATE_API_KEYS, bind to 127.0.0.1, or set "
            "LANEGATE_ALLOW_ANONYMOUS=true to accept every caller as 'anonymous'")


def main(args: argparse.Namespace) -> int:
    """``lanegate gateway``: serve ``create_app`` on ``host:port`` until SIGINT/SIGTERM."""
    settings = from_args(args)
    configure_logging(settings.log_level, settings.log_format, process="gateway")
    if not settings.redis_url:
        log.error("no_redis_url", message="set --redis-url or LANEGATE_REDIS_URL "
                  "(`lanegate up` starts its own Redis)")
        return 2
    refusal = anonymous_refusal(settings)
    if refusal is not None:
        log.error("auth_off_refused", host=settings.host, message=refusal)
        print(f"lanegate gateway: {refusal}", file=sys.stderr)
        return 2
    if not auth_enabled(settings):
        log.warning("auth_off", message="LANEGATE_API_KEYS is empty: every caller is "
                    "accepted as tenant 'anonymous'")
    log.info("gateway_start", host=settings.host, port=settings.port)
    # handler_cancellation: a request whose client left stops (an OpenAI request no
    # longer waits for its job; the job goes on and uploads clean up after themselves)
    web.run_app(create_app(settings), host=settings.host, port=settings.port,
                print=None, shutdown_timeout=settings.drain_timeout_s + 5.0,
                access_log=None, handler_cancellation=True, loop=new_loop(settings.event_loop))
    log.info("gateway_stop")
    return 0
