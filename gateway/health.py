"""``/healthz``, ``/readyz`` and ``/metrics`` of the gateway.

* ``/healthz``: the process answers (200 ``{"status":"ok"}``).
* ``/readyz``: 200 when Redis answers PING and at least one realtime (or mixed)
  worker is alive in the registry; otherwise 503 with the reason
  (``{"status":"unready","reason":"redis_unreachable"|"no_realtime_worker"}``).
* ``/metrics``: Prometheus text; the cluster gauges (workers alive, queue depth,
  oldest queued age) are refreshed from Redis first, skipped if Redis is down.
"""

from __future__ import annotations

from aiohttp import web
from redis.exceptions import RedisError

from gateway.state import REDIS
from lanegate import metrics
from lanegate.logs import get_logger
from workers.registry import list_workers

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


async def metrics_handler(request: web.Request) -> web.Response:
    try:
        await metrics.refresh_cluster_gauges(request.app[REDIS])
    except (RedisError, OSError) as exc:
        log.debug("metrics_refresh_failed", error=str(exc))
    return await metrics.metrics_view(request)


def setup_health(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
