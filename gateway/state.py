"""Typed application state of the gateway (``web.AppKey``s), shared by its modules.

``create_app`` (``gateway/app.py``) fills these, the resources in its
``cleanup_ctx``; route modules read them:

* ``SETTINGS``: the process's ``Settings``;
* ``GATEWAY_ID``: this process's id, under which its heartbeat and leases live;
* ``LEASES``: this gateway's live session leases, kept fresh (``gateway/auth.py``);
* ``REDIS``: the ``redis.asyncio`` client (job store, registry, session counts);
* ``JOBS``: the ``JobStore`` on that client and the blob store (uploads, job results);
* ``HTTP``: the ``aiohttp.ClientSession`` used for internal worker WebSockets;
* ``LINKS``: the internal links to workers, one per worker (``gateway/links.py``);
* ``SOCKETS``: the open public WebSockets, closed with 1001 on shutdown;
* ``STREAMS``: the live ``/v1/stream`` sessions, drained on shutdown;
* ``UPLOAD_POOL``: the bounded thread pool of upload decoding, blob writes and
  webhook lookups (``upload_threads``), apart from the default pool;
* ``GAUGES``: when ``/metrics`` last read the cluster gauges from Redis;
* ``WYOMING``: the Wyoming TCP server and its open connections (``gateway/wyoming.py``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web

from lanegate.settings import Settings
from lanes.jobs import JobStore

if TYPE_CHECKING:
    from gateway.auth import SessionLeases
    from gateway.health import GaugeCache
    from gateway.links import WorkerLinks
    from gateway.stream import StreamSession
    from gateway.wyoming import WyomingServer

SETTINGS = web.AppKey("settings", Settings)
GATEWAY_ID = web.AppKey("gateway_id", str)
REDIS = web.AppKey("redis", aioredis.Redis)
LEASES: web.AppKey[SessionLeases] = web.AppKey("leases")
JOBS = web.AppKey("jobs", JobStore)
HTTP = web.AppKey("http", aiohttp.ClientSession)
LINKS: web.AppKey[WorkerLinks] = web.AppKey("links")
SOCKETS: web.AppKey[set[web.WebSocketResponse]] = web.AppKey("sockets")
STREAMS: web.AppKey[set[StreamSession]] = web.AppKey("stream_sessions")
UPLOAD_POOL = web.AppKey("upload_pool", ThreadPoolExecutor)
GAUGES: web.AppKey[GaugeCache] = web.AppKey("gauges")
WYOMING: web.AppKey[WyomingServer] = web.AppKey("wyoming")
