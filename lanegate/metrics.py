"""Prometheus metrics; every series is labelled by ``lane`` (worker series also ``worker``).

Buckets resolve both the 50 ms step budget and the 300 ms realtime red line.

Who emits what (the dashboard and alerts in ``deploy/`` read exactly these):

* realtime / mixed worker (``/metrics`` on its worker port): step duration, realtime
  factor, active sessions, free slots, soft cuts, audio seconds, event-loop lag, and
  the two that say whether a ``mixed`` pool would gain from the split: live stall
  (how long live streams waited behind a long prefill) and long-prefill seconds
  (``rate()`` of it is the share of the loop's wall time spent in long prefills);
* batch worker (``/metrics`` on its worker port): step duration, realtime factor,
  soft cuts, audio seconds, job duration, queue wait, jobs ``completed``/``failed``;
* gateway (``/metrics`` on its port): first-partial, partial and final latency,
  rejections, stream failovers, jobs ``queued``/``cancelled``, open worker links, and,
  set at each scrape by ``gateway.health`` from the registry and the queue, workers
  alive, queue depth and oldest queued age.

Call ``init_gateway_series()`` / ``init_worker_series(lane, worker)`` at start and
serve ``metrics_view`` at ``GET /metrics``: lanegate's series first, then the Python
runtime's (``process_*``, ``python_*``), which a reader looks at last.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

PREFIX = "lanegate_"

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

LIVE_STALL = Histogram(
    "lanegate_live_stall_seconds",
    "How long a live stream waited behind a long prefill (a whole upload decoded in a mixed "
    "worker's loop): one observation per live stream in the loop while it ran.",
    ["lane", "worker"], buckets=LATENCY_BUCKETS,
)
LONG_PREFILL_SECONDS = Counter(
    "lanegate_long_prefill_seconds_total",
    "Wall time a worker's loop spent in long prefills (uploads decoded in one piece in a "
    "mixed worker); its rate is the share of wall time.",
    ["lane", "worker"],
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


PROTOCOL_SESSIONS = Counter(
    "lanegate_protocol_sessions_total",
    "Realtime-lane sessions of the gateway's adapter protocols (Wyoming), by lane, protocol "
    "and how they ended (`done`, `client_gone`, or the error code).",
    ["lane", "protocol", "outcome"],
)


class FailoverOutcome(enum.Enum):
    """How moving a live stream off a lost worker ended."""

    OK = "ok"  # another worker took it; the client saw no error
    NO_WORKER = "no_worker"  # no live worker had a free slot: ``worker_lost`` (1011)
    FAILED = "failed"  # Redis down, or the new worker refused or broke: ``worker_lost``


FAILOVERS = Counter(
    "lanegate_failovers_total",
    "Live streams moved off a lost worker (gateway side), by outcome.", ["lane", "outcome"],
)
PARKED_SESSIONS = Gauge(
    "lanegate_parked_sessions",
    "Live sessions (OpenAI Realtime API, Deepgram) open without a decoder slot: silent, "
    "parked until their next audio (gateway side).", ["lane"],
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
    PARKED_SESSIONS.labels(lane="realtime")
    for outcome in FailoverOutcome:
        FAILOVERS.labels(lane="realtime", outcome=outcome.value)
    for ended in ("done", "client_gone", "overloaded"):
        PROTOCOL_SESSIONS.labels(lane="realtime", protocol="wyoming", outcome=ended)


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
        LIVE_STALL.labels(lane=lane, worker=worker)
        LONG_PREFILL_SECONDS.labels(lane=lane, worker=worker)


def record_long_prefill(labels: dict[str, str], seconds: float, live_streams: int) -> None:
    """A long prefill of ``seconds`` ran in a worker's loop while ``live_streams`` live
    streams waited for their next step."""
    LONG_PREFILL_SECONDS.labels(**labels).inc(seconds)
    stall = LIVE_STALL.labels(**labels)
    for _ in range(live_streams):
        stall.observe(seconds)


class LanegateFirst:
    """The default registry with lanegate's families ahead of the runtime's."""

    def collect(self) -> Iterator[Metric]:
        families = list(REGISTRY.collect())
        yield from (f for f in families if f.name.startswith(PREFIX))
        yield from (f for f in families if not f.name.startswith(PREFIX))


def render() -> bytes:
    """The text exposition of every series, lanegate's first."""
    return generate_latest(LanegateFirst())


async def metrics_view(request: web.Request) -> web.Response:
    """aiohttp handler for ``GET /metrics`` (text format, lanegate's series first)."""
    return web.Response(body=render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
