"""Prometheus metrics; every series is labelled by ``lane`` (worker series also ``worker``).

Buckets resolve both the 50 ms step budget and the 300 ms realtime red line.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
)
JOB_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)

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
    "lanegate_soft_cuts_total", "Segments ended by the VAD, by reason.", ["lane", "reason"]
)
AUDIO_SECONDS = Counter(
    "lanegate_audio_seconds_total", "Audio seconds processed by an engine.", ["lane", "worker"]
)
JOB_DURATION = Histogram(
    "lanegate_job_duration_seconds", "First claim to stored result of a batch job.",
    ["lane", "worker"], buckets=JOB_BUCKETS,
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
QUEUE_WAIT = Histogram(
    "lanegate_queue_wait_seconds", "Job enqueue to first claim by a worker.",
    ["lane"], buckets=JOB_BUCKETS,
)
QUEUE_DEPTH = Gauge("lanegate_queue_depth", "Jobs waiting or running.", ["lane"])
QUEUE_OLDEST_AGE = Gauge(
    "lanegate_queue_oldest_age_seconds", "Age of the oldest unfinished job entry.", ["lane"]
)
WORKERS = Gauge("lanegate_workers", "Workers alive in the registry.", ["lane"])
REJECTIONS = Counter(
    "lanegate_rejections_total", "Requests or sessions refused, by reason.", ["lane", "reason"]
)
JOBS = Counter("lanegate_jobs_total", "Batch jobs reaching a status.", ["lane", "status"])
