"""Prometheus metrics; every series is labelled by ``lane`` (worker series also ``worker``).

Buckets resolve both the 50 ms step budget and the 300 ms realtime red line.

Who emits what (the dashboard and alerts in ``deploy/`` read exactly these):

* realtime / mixed worker (``/metrics`` on its worker port): step duration, realtime
  factor, active sessions, free slots, soft cuts, audio seconds, event-loop lag;
* batch worker (``/metrics`` on its worker port): step duration, realtime factor,
  soft cuts, audio seconds, job duration, queue wait, jobs ``completed``/``failed``;
* gateway (``/metrics`` on its port): first-partial, partial and final latency,
  rejections, jobs ``queued``/``cancelled``, open worker links, and, refreshed from
  Redis at each scrape by ``refresh_cluster_gauges``, workers alive, queue depth and
  oldest queued age.

Call ``init_gateway_series()`` / ``init_worker_series(lane, worker)`` at start and
serve ``metrics_view`` at ``GET /metrics``.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from redis.exceptions import ResponseError

from lanegate.constants import JOB_GROUP, JOB_STREAM, LANES

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
)
JOB_BUCKETS = (
    0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
    7200.0,
)
#: queue wait: from milliseconds (idle pool) to an hour (deep backlog)
QUEUE_BUCKETS = (*LATENCY_BUCKETS, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)

#: label values known up front; processes create these series at start (value 0)
#: with ``init_gateway_series`` / ``init_worker_series`` so that rates and alerts
#: read 0 instead of "no data" before the first event.
REJECTION_REASONS = (
    "unauthorized", "overloaded", "too_large", "bad_request", "timeout", "too_long", "undecodable",
)
SOFT_CUT_REASONS = ("endpoint", "max_window", "end")
JOB_STATUSES = ("queued", "completed", "failed", "cancelled")

# --- worker side ------------------------------------------------------------
STEP_DURATION = Histogram(
    "lanegate_step_duration_seconds", "Wall time of one engine step.",
    ["lane", "worker"], buckets=LATENCY_BUCKETS,
)
REALTIME_FACTOR = Histogram(
    "lanegate_realtime_factor", "Compute seconds per audio second of a step or job.",
    ["lane", "worker"], buckets=RTF_BUCKETS,
)
ACTIVE_SESSIONS = Gauge(
    "lanegate_active_sessions", "Sessions holding a decoder slot.", ["lane", "worker"]
)
FREE_SLOTS = Gauge("lanegate_free_slots", "Free decoder slots.", ["lane", "worker"])
SOFT_CUTS = Counter(
    "lanegate_soft_cuts_total", "Segments ended by the VAD, by reason (the final's `cut`).",
    ["lane", "worker", "reason"],
)
AUDIO_SECONDS = Counter(
    "lanegate_audio_seconds_total", "Audio seconds processed by an engine.", ["lane", "worker"]
)
EVENT_LOOP_LAG = Histogram(
    "lanegate_event_loop_lag_seconds",
    "How late a worker's event loop wakes a timer: network I/O waiting behind engine work.",
    ["lane", "worker"], buckets=LATENCY_BUCKETS,
)
JOB_DURATION = Histogram(
    "lanegate_job_duration_seconds", "First claim to stored result of a batch job.",
    ["lane", "worker"], buckets=JOB_BUCKETS,
)
QUEUE_WAIT = Histogram(
    "lanegate_queue_wait_seconds", "Job enqueue to first claim by a worker.",
    ["lane", "worker"], buckets=QUEUE_BUCKETS,
)
#: job transitions: the gateway counts ``queued`` and ``cancelled`` with ``worker=""``
#: (an empty label is no label in Prometheus); batch workers count ``completed`` and
#: ``failed`` with their worker id.
JOBS = Counter(
    "lanegate_jobs_total", "Batch jobs reaching a status.", ["lane", "worker", "status"]
)

# --- gateway side -------------------------------------------------------------
FIRST_PARTIAL = Histogram(
    "lanegate_first_partial_seconds", "Session start to the first partial sent.",
    ["lane"], buckets=LATENCY_BUCKETS,
)
PARTIAL_LATENCY = Histogram(
    "lanegate_partial_latency_seconds",
    "Audio chunk received at the gateway to the partial covering it leaving the gateway.",
    ["lane"], buckets=LATENCY_BUCKETS,
)
FINAL_LATENCY = Histogram(
    "lanegate_final_latency_seconds", "End of speech received to the final sent.",
    ["lane"], buckets=LATENCY_BUCKETS,
)
QUEUE_DEPTH = Gauge("lanegate_queue_depth", "Jobs waiting or running.", ["lane"])
QUEUE_OLDEST_AGE = Gauge(
    "lanegate_queue_oldest_age_seconds", "Age of the oldest unfinished job entry.", ["lane"]
)
WORKERS = Gauge("lanegate_workers", "Workers alive in the registry.", ["lane"])
GATEWAY_WORKER_LINKS = Gauge(
    "lanegate_gateway_worker_links",
    "Internal links open from this gateway to workers (one per worker), by worker lane.",
    ["lane"],
)
REJECTIONS = Counter(
    "lanegate_rejections_total", "Requests or sessions refused, by reason.", ["lane", "reason"]
)


# --- helpers ------------------------------------------------------------------------


def init_gateway_series(lanes: tuple[str, ...] = ("realtime", "batch")) -> None:
    """Create the gateway's counter series at 0, so rates read 0 before the first event."""
    for lane in lanes:
        for reason in REJECTION_REASONS:
            REJECTIONS.labels(lane=lane, reason=reason)
    for status in ("queued", "cancelled"):
        JOBS.labels(lane="batch", worker="", status=status)
    GATEWAY_WORKER_LINKS.labels(lane="realtime")


def init_worker_series(lane: str, worker: str) -> None:
    """Create a worker's counter series at 0 (call once at worker start)."""
    for reason in SOFT_CUT_REASONS:
        SOFT_CUTS.labels(lane=lane, worker=worker, reason=reason)
    AUDIO_SECONDS.labels(lane=lane, worker=worker)
    if lane == "batch":
        for status in ("completed", "failed"):
            JOBS.labels(lane=lane, worker=worker, status=status)
    else:
        ACTIVE_SESSIONS.labels(lane=lane, worker=worker)
        FREE_SLOTS.labels(lane=lane, worker=worker)


_XRANGE_CAP = 10_000


def _str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _id_ms(entry_id: object) -> int:
    return int(_str(entry_id).split("-", 1)[0])


async def refresh_cluster_gauges(redis: Any, now: float | None = None) -> None:
    """Set ``lanegate_workers``, ``lanegate_queue_depth`` and
    ``lanegate_queue_oldest_age_seconds`` from Redis (the gateway calls this before
    rendering ``/metrics``; a few Redis round trips per scrape).

    Queue depth is the consumer group's undelivered entries plus its pending
    (delivered, not acknowledged) entries; the oldest age comes from the stream
    entry ids, which are millisecond timestamps of the XADD.
    """
    from workers.registry import list_workers  # lazy: workers imports lanegate

    now_ms = (time.time() if now is None else now) * 1000.0
    counts = dict.fromkeys(LANES, 0)
    for info in await list_workers(redis, "realtime") + await list_workers(redis, "batch"):
        if info.lane in counts:
            counts[info.lane] += 1
    for lane, n in counts.items():
        WORKERS.labels(lane=lane).set(n)

    depth = 0
    oldest_ms: int | None = None
    try:
        groups = await redis.xinfo_groups(JOB_STREAM)
    except ResponseError:  # no stream yet
        groups = []
    for group in groups:
        if _str(group.get("name", "")) != JOB_GROUP:
            continue
        pending = int(group.get("pending") or 0)
        last = _str(group.get("last-delivered-id") or "0-0")
        undelivered = await redis.xrange(
            JOB_STREAM, min="(" + last, max="+", count=_XRANGE_CAP
        )
        # Counted, not the group's `lag`: finished entries are XDELed, and Redis's lag
        # estimate can still include deleted entries. Beyond the cap, lag is the estimate.
        lag = group.get("lag")
        waiting = len(undelivered)
        if waiting >= _XRANGE_CAP and lag is not None:
            waiting = max(waiting, int(lag))
        depth = pending + waiting
        if undelivered:
            oldest_ms = _id_ms(undelivered[0][0])
        if pending:
            summary = await redis.xpending(JOB_STREAM, JOB_GROUP)
            if summary.get("min"):
                first = _id_ms(summary["min"])
                oldest_ms = first if oldest_ms is None else min(oldest_ms, first)
    QUEUE_DEPTH.labels(lane="batch").set(depth)
    QUEUE_OLDEST_AGE.labels(lane="batch").set(
        0.0 if oldest_ms is None else max(0.0, (now_ms - oldest_ms) / 1000.0)
    )


async def metrics_view(request: web.Request) -> web.Response:
    """aiohttp handler for ``GET /metrics`` (the default registry, text format)."""
    return web.Response(body=generate_latest(REGISTRY),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})
