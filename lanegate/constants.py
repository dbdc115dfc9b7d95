"""Redis key names and the wire values more than one package shares: the audio
format, worker lanes, the close codes both sides send, the gateway-worker link."""

from __future__ import annotations

import enum

PREFIX = "lanegate"

# --- worker registry ----------------------------------------------------
#: set of worker ids per lane; each id's record lives at WORKER_KEY and expires
WORKERS_KEY = PREFIX + ":workers:{lane}"
#: JSON record of one worker, written with a TTL by its heartbeat
WORKER_KEY = PREFIX + ":worker:{worker_id}"

# --- batch lane -----------------------------------------------------------
#: the job stream (XADD / XREADGROUP) and its consumer group
JOB_STREAM = PREFIX + ":jobs:stream"
JOB_GROUP = "batch"
#: fair scheduling: tenants with jobs waiting to be put on the stream (a list, rotated)
FAIR_RING_KEY = PREFIX + ":jobs:ring"
#: one tenant's jobs waiting to be put on the stream, oldest first (list of job ids)
FAIR_WAITING_KEY = PREFIX + ":jobs:waiting:{tenant}"
#: one tenant's unfinished jobs (queued or processing): hash job id -> audio seconds
TENANT_OPEN_KEY = PREFIX + ":tenant:{tenant}:open"
#: entries that ran out of attempts
DEAD_LETTER_STREAM = PREFIX + ":jobs:dead"
#: hash with one job's state
JOB_KEY = PREFIX + ":job:{job_id}"
#: stored result (JSON) of one job
RESULT_KEY = PREFIX + ":result:{job_id}"
#: sorted set of one API key's jobs, scored by creation time
TENANT_JOBS_KEY = PREFIX + ":tenant:{tenant}:jobs"
#: Idempotency-Key -> job id
IDEMPOTENCY_KEY = PREFIX + ":idem:{tenant}:{key}"
#: webhook deliveries by due time (sorted set of job ids, score = epoch seconds);
#: a dispatcher leases one by pushing its score forward, so a crash re-delivers
WEBHOOK_DUE_KEY = PREFIX + ":webhooks:due"
#: one pending webhook delivery (hash: job_id, url, status, attempts)
WEBHOOK_KEY = PREFIX + ":webhook:{job_id}"

#: held (SET NX PX) by the batch worker sweeping orphaned blobs this interval
BLOB_SWEEP_LOCK_KEY = PREFIX + ":blobs:sweep"

# --- sessions -------------------------------------------------------------
#: concurrent stream sessions of one API key: a sorted set of ``<gateway id>/<session
#: id>`` scored by lease expiry (a live session renews its lease; expired ones and those
#: of a gateway whose heartbeat is gone are trimmed)
KEY_SESSIONS_KEY = PREFIX + ":sessions:{tenant}"
#: a live gateway's heartbeat (PX ``gateway_lease_s``): its streams' leases hang on it
GATEWAY_KEY = PREFIX + ":gateway:{gateway_id}"

# --- audio ----------------------------------------------------------------
ENGINE_SAMPLE_RATE = 16000
SAMPLE_WIDTH = 2



class WorkerLane(enum.StrEnum):
    """The lane a worker process serves (a mixed worker is listed with the realtime ones)."""

    REALTIME = "realtime"
    BATCH = "batch"
    MIXED = "mixed"


LANES: tuple[str, ...] = tuple(WorkerLane)

# --- WebSocket close codes -------------------------------------------------
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_TOO_LARGE = 1009
CLOSE_INTERNAL = 1011
CLOSE_OVERLOADED = 1013

# --- gateway-worker link (docs/INTERNALS.md) -----------------------------------
#: the header a gateway presents its deployment's ``internal_token`` in
INTERNAL_TOKEN_HEADER = "X-Lanegate-Internal-Token"
#: the worker's endpoint that multiplexes a gateway's sessions on one WebSocket
LINK_PATH = "/internal/v1/link"
#: a binary batch is flushed once its records pass this many bytes (so a batch is
#: at most this plus one frame); the worker sizes its max_msg_size from it
LINK_BATCH_BYTES = 1_048_576
#: header of one audio record in a binary batch: channel, PCM byte length
LINK_RECORD_HEADER = "<II"
