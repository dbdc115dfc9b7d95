"""Typed application state of the gateway (``web.AppKey``s), shared by its modules.

``create_app`` (``gateway/app.py``) fills these; route modules read them:

* ``SETTINGS``: the process's ``Settings``;
* ``REDIS``: the ``redis.asyncio`` client (job store, registry, session counts);
* ``HTTP``: the ``aiohttp.ClientSession`` used for internal worker WebSockets;
* ``SOCKETS``: the open public WebSockets, closed with 1001 on shutdown;
* ``LINKS``: the internal links to workers, one per worker (``gateway/links.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web

from lanegate.settings import Settings

if TYPE_CHECKING:
    from gateway.links import WorkerLinks

SETTINGS = web.AppKey("settings", Settings)
REDIS = web.AppKey("redis", aioredis.Redis)
HTTP = web.AppKey("http", aiohttp.ClientSession)
SOCKETS: web.AppKey[set[web.WebSocketResponse]] = web.AppKey("sockets")
LINKS: web.AppKey[WorkerLinks] = web.AppKey("links")
