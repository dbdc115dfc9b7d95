"""Every Redis key name and other wire-level constant, in one place."""

from __future__ import annotations

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
#: flag that a job was cancelled (workers check it between batches)
CANCEL_KEY = PREFIX + ":cancel:{job_id}"
#: pending webhook deliveries (stream)
WEBHOOK_STREAM = PREFIX + ":webhooks"
#: webhook deliveries by due time (sorted set of job ids, score = epoch seconds);
#: a dispatcher leases one by pushing its score forward, so a crash re-delivers
WEBHOOK_DUE_KEY = PREFIX + ":webhooks:due"
#: one pending webhook delivery (hash: job_id, url, status, attempts)
WEBHOOK_KEY = PREFIX + ":webhook:{job_id}"

# --- sessions -------------------------------------------------------------
#: concurrent stream sessions of one API key (counter with TTL refresh)
KEY_SESSIONS_KEY = PREFIX + ":sessions:{tenant}"

# --- audio ----------------------------------------------------------------
ENGINE_SAMPLE_RATE = 16000
SAMPLE_WIDTH = 2

LANES = ("realtime", "batch", "mixed")

# --- WebSocket close codes -------------------------------------------------
CLOSE_NORMAL = 1000
CLOSE_POLICY = 1008
CLOSE_TOO_LARGE = 1009
CLOSE_INTERNAL = 1011
CLOSE_OVERLOADED = 1013

# --- gateway-worker link (/internal/v1/link, docs/INTERNALS.md) ---------------
#: a binary batch is flushed once its records pass this many bytes (so a batch is
#: at most this plus one frame); the worker sizes its max_msg_size from it
LINK_BATCH_BYTES = 1_048_576
#: header of one audio record in a binary batch: channel, PCM byte length
LINK_RECORD_HEADER = "<II"
