"""``/healthz``, ``/readyz`` and ``/metrics`` of the gateway.

* ``/healthz``: the process answers (200 ``{"status":"ok"}``).
* ``/readyz``: 200 when Redis answers PING and at least one realtime (or mixed)
  worker is alive in the registry; otherwise 503 with the reason
  (``{"status":"unready","reason":"redis_unreachable"|"no_realtime_worker"}``).
* ``/metrics``: Prometheus text; the cluster gauges (workers alive, queue depth,
  oldest queued age) are refreshed from Redis first, at most once per
  ``metrics_cache_s`` (concurrent scrapes share one refresh), skipped if Redis is
  down. Scrapes in between cost no Redis call, so hitting ``/metrics`` in a loop
  does not turn into scans of the job stream.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from gateway.state import GAUGES, REDIS, SETTINGS
from lanegate import metrics
from lanegate.constants import LANES
from lanegate.logs import get_logger
from lanes.queue import backlog
from lanes.registry import list_workers

log = get_logger("gateway.health")


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def _unready(reason: str, message: str) -> web.Response:
    return web.json_response(
        {"status": "unready", "reason": reason, "message": message}, status=503,
        headers={"Retry-After": "1"},
    )


async def readyz(request: web.Request) -> web.Response:
    redis = request.app[REDIS]
    try:
        await redis.ping()
        workers = await list_workers(redis, "realtime")
    except (RedisError, OSError) as exc:
        return _unready("redis_unreachable", f"Redis does not answer: {exc}")
    live = [w for w in workers if not w.draining]
    if not live:
        return _unready("no_realtime_worker", "no live realtime or mixed worker in the registry")
    return web.json_response({
        "status": "ready",
        "realtime_workers": len(live),
        "free_slots": sum(w.slots_free for w in live),
    })


async def refresh_cluster_gauges(redis: Any, now: float | None = None) -> None:
    """Set ``lanegate_workers``, ``lanegate_queue_depth`` and
    ``lanegate_queue_oldest_age_seconds`` from the registry and the job stream (before
    rendering ``/metrics``; a few Redis round trips per scrape)."""
    counts = dict.fromkeys(LANES, 0)
    for info in await list_workers(redis, "realtime") + await list_workers(redis, "batch"):
        if info.lane in counts:
            counts[info.lane] += 1
    for lane, n in counts.items():
        metrics.WORKERS.labels(lane=lane).set(n)
    queued = await backlog(redis)
    metrics.QUEUE_DEPTH.labels(lane="batch").set(queued.depth)
    metrics.QUEUE_OLDEST_AGE.labels(lane="batch").set(queued.oldest_age_s(now))


@dataclass
class GaugeCache:
    """When the cluster gauges were last read from Redis; one refresh at a time."""

    refreshed_at: float = -float("inf")
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def refresh(self, redis: Any, ttl_s: float) -> None:
        async with self.lock:
            if time.monotonic() - self.refreshed_at < ttl_s:
                return  # fresh enough, or refreshed by the scrape this one waited for
            try:
                await refresh_cluster_gauges(redis)
            except (RedisError, OSError) as exc:
                log.debug("metrics_refresh_failed", error=str(exc))
            self.refreshed_at = time.monotonic()


async def metrics_handler(request: web.Request) -> web.Response:
    await request.app[GAUGES].refresh(request.app[REDIS], request.app[SETTINGS].metrics_cache_s)
    return await metrics.metrics_view(request)


def setup_health(app: web.Application) -> None:
    app[GAUGES] = GaugeCache()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
