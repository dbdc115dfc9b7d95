"""The batch lane's job protocol in Redis, defined once: the job hash, the stream
entry, the status values and every Lua script that changes them (``SUBMIT`` and
``CANCEL`` for the gateway's ``lanes.jobs``, the worker transitions for
``lanes.queue``). The webhook record a transition schedules is
``lanegate.webhooks``' schema.

Statuses: ``queued -> processing -> completed | failed``; ``queued | processing
-> cancelled``; a processing job whose worker hands it back goes to ``queued``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from engines.base import Task
from lanegate.constants import FAIR_WAITING_KEY, JOB_KEY, TENANT_OPEN_KEY
from lanegate.webhooks import SCHEDULE_WEBHOOK_LUA


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    PROCESSING = "processing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED)


class Outcome(enum.StrEnum):
    """What ``START`` decided for a delivered entry."""

    RUN = "run"  # this worker now owns the job for one attempt
    SKIP = "skip"  # cancelled, finished, expired or superseded: the entry was dropped
    DEAD = "dead"  # out of attempts: dead-lettered and failed


class Standing(enum.StrEnum):
    """A held job, as a worker sees it between two batches."""

    OK = "ok"  # still processing under this worker's attempt
    CANCELLED = "cancelled"
    LOST = "lost"  # another attempt owns it, it finished elsewhere, or it expired


# --- the job hash -----------------------------------------------------------------


def _opt_float(raw: str) -> float | None:
    return float(raw) if raw else None


def _opt_str(raw: str) -> str | None:
    return raw or None


@dataclass(frozen=True)
class Job:
    id: str
    tenant: str
    status: JobStatus
    created_at: float  # epoch seconds
    updated_at: float
    started_at: float | None  # first time a worker began processing it
    finished_at: float | None  # when it reached a terminal status
    audio_seconds: float
    progress: float  # 0..1: audio decoded / audio total
    attempts: int  # deliveries to a worker so far
    error: str | None
    language: str  # "" until the worker reports the one it detected
    response_format: str
    webhook_url: str | None
    filename: str | None
    worker: str | None = None  # the worker processing it (or that last did)
    partial_text: str = ""  # text of the segments decoded so far (internal, not public)
    prompt: str = ""  # the decoder's initial prompt (internal, not public)
    temperature: float | None = None  # None: the engine's default
    task: Task = Task.TRANSCRIBE  # TRANSLATE: English text (internal, not public)

    @property
    def terminal(self) -> bool:
        return self.status.terminal

    def to_public(self) -> dict[str, Any]:
        """The JSON the API returns. Timestamps are epoch seconds (floats, ms
        resolution) or null; ``tenant`` and ``worker`` are never exposed."""
        return {
            "id": self.id,
            "object": "transcription.job",
            "status": self.status,
            "progress": round(self.progress, 4),
            "created_at": _ms(self.created_at),
            "updated_at": _ms(self.updated_at),
            "started_at": _ms(self.started_at),
            "finished_at": _ms(self.finished_at),
            "audio_seconds": round(self.audio_seconds, 3),
            "attempts": self.attempts,
            "error": self.error,
            "language": self.language,
            "response_format": self.response_format,
            "webhook_url": self.webhook_url,
            "filename": self.filename,
        }

    @classmethod
    def from_hash(cls, raw: dict[str, str]) -> Job:
        return cls(
            id=raw["id"],
            tenant=raw["tenant"],
            status=JobStatus(raw["status"]),
            created_at=float(raw["created_at"]),
            updated_at=float(raw.get("updated_at") or raw["created_at"]),
            started_at=_opt_float(raw.get("started_at", "")),
            finished_at=_opt_float(raw.get("finished_at", "")),
            audio_seconds=float(raw.get("audio_seconds") or 0.0),
            progress=float(raw.get("progress") or 0.0),
            attempts=int(raw.get("attempts") or 0),
            error=_opt_str(raw.get("error", "")),
            language=raw.get("language") or "",
            response_format=raw.get("response_format") or "json",
            webhook_url=_opt_str(raw.get("webhook_url", "")),
            filename=_opt_str(raw.get("filename", "")),
            worker=_opt_str(raw.get("worker", "")),
            partial_text=raw.get("partial_text") or "",
            prompt=raw.get("prompt") or "",
            temperature=_opt_float(raw.get("temperature", "")),
            task=Task(raw.get("task") or Task.TRANSCRIBE),
        )


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def new_job_hash(*, job_id: str, tenant: str, now: float, audio_seconds: float,
                 language: str, response_format: str, webhook_url: str | None,
                 filename: str | None, prompt: str = "",
                 temperature: float | None = None,
                 task: Task = Task.TRANSCRIBE) -> dict[str, str]:
    """Every field of a just-submitted job (``Job.from_hash`` reads them back)."""
    return {
        "id": job_id, "tenant": tenant, "status": JobStatus.QUEUED, "created_at": repr(now),
        "updated_at": repr(now), "started_at": "", "finished_at": "",
        "audio_seconds": repr(float(audio_seconds)), "progress": "0", "attempts": "0",
        "error": "", "language": language, "response_format": response_format,
        "webhook_url": webhook_url or "", "filename": filename or "", "worker": "",
        "prompt": prompt, "temperature": "" if temperature is None else repr(temperature),
        "task": task.value,
    }


# --- the stream entry ---------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    """One stream entry handed to a worker (written by ``enqueue`` below)."""

    entry_id: str
    job_id: str
    tenant: str
    enqueued_at: float

    @classmethod
    def from_entry(cls, entry_id: str, fields: dict[str, str]) -> Delivery:
        return cls(entry_id, fields["job_id"], fields.get("tenant", ""),
                   float(fields.get("enqueued_at") or 0.0))


_ENQUEUE = """
local function enqueue(stream, job_id, tenant, now)
  return redis.call('XADD', stream, '*', 'job_id', job_id, 'tenant', tenant,
                    'enqueued_at', now)
end
"""



def _lua_key(template: str, field: str) -> str:
    """A Lua expression for ``template`` with ``field`` taken from the Lua variable."""
    head, _, tail = template.partition("{" + field + "}")
    return f"'{head}' .. {field} .. '{tail}'"


# Fair scheduling. The stream holds at most a small window of undelivered entries;
# the rest of each tenant's jobs wait in the tenant's own list, and ``feed`` moves
# them to the stream one tenant at a time, round-robin (the ring is rotated on each
# move), whenever the window has room: on every submit and before every worker
# read. Delivery, acknowledgement, reclaim and fencing stay the stream's.
_FAIR = f"""
local function waiting_key(tenant) return {_lua_key(FAIR_WAITING_KEY, "tenant")} end
local function job_key(job_id) return {_lua_key(JOB_KEY, "job_id")} end
local function open_key(tenant) return {_lua_key(TENANT_OPEN_KEY, "tenant")} end
local function undelivered(stream, group)
  local pending = redis.pcall('XPENDING', stream, group)
  local n = redis.call('XLEN', stream)
  if type(pending) == 'table' and pending.err == nil then n = n - pending[1] end
  return n
end
local function feed(stream, group, ring, window, now)
  local room = tonumber(window) - undelivered(stream, group)
  local fed = 0
  while room > 0 do
    local tenant = redis.call('LMOVE', ring, ring, 'LEFT', 'RIGHT')
    if not tenant then break end
    local waiting = waiting_key(tenant)
    local job_id = redis.call('LPOP', waiting)
    if redis.call('LLEN', waiting) == 0 then redis.call('LREM', ring, 0, tenant) end
    if job_id then
      local job = job_key(job_id)
      local entry = redis.call('HGET', job, 'entry')
      if redis.call('HGET', job, 'status') == 'queued' and (not entry or entry == '') then
        redis.call('HSET', job, 'entry', enqueue(stream, job_id, tenant, now))
        room = room - 1
        fed = fed + 1
      end
    end
  end
  return fed
end
-- a job leaves its tenant's quota when it finishes (idempotent)
local function close_open(job, job_id)
  local tenant = redis.call('HGET', job, 'tenant')
  if tenant then redis.call('HDEL', open_key(tenant), job_id) end
end
"""

# --- the gateway's scripts ----------------------------------------------------------

class Quota(enum.StrEnum):
    """Which per-key quota a refused submit would have passed."""

    JOBS = "jobs"
    AUDIO = "audio"


# KEYS: job, tenant_jobs, stream, idem, tenant_open, ring, tenant_waiting
# ARGV: job_id, use_idem, idem_ttl_ms, job_ttl_ms, now, tenant, group, window,
#       max_jobs, max_audio_s, audio_s, field/value pairs...
# Returns {job_id, 1} (queued), {job_id, 0} (a replay) or {'', -1, quota} (refused).
SUBMIT = _ENQUEUE + _FAIR + """
if ARGV[2] == '1' then
  local existing = redis.call('GET', KEYS[4])
  if existing then return {existing, 0} end
end
if redis.call('EXISTS', KEYS[1]) == 1 then return {ARGV[1], 0} end
local max_jobs, max_audio = tonumber(ARGV[9]), tonumber(ARGV[10])
if max_jobs > 0 and redis.call('HLEN', KEYS[5]) >= max_jobs then return {'', -1, 'jobs'} end
if max_audio > 0 then
  local total = tonumber(ARGV[11])
  for _, seconds in ipairs(redis.call('HVALS', KEYS[5])) do total = total + tonumber(seconds) end
  if total > max_audio then return {'', -1, 'audio'} end
end
local fields = {}
for i = 12, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('HSET', KEYS[1], 'entry', '')
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('HSET', KEYS[5], ARGV[1], ARGV[11])
redis.call('PEXPIRE', KEYS[5], ARGV[4])
redis.call('RPUSH', KEYS[7], ARGV[1])
if not redis.call('LPOS', KEYS[6], ARGV[6]) then redis.call('RPUSH', KEYS[6], ARGV[6]) end
if ARGV[2] == '1' then redis.call('SET', KEYS[4], ARGV[1], 'PX', ARGV[3]) end
feed(KEYS[3], ARGV[7], KEYS[6], ARGV[8], ARGV[5])
return {ARGV[1], 1}
"""

# KEYS: job, result   ARGV: now, job_ttl_ms, job_id
CANCEL = _ENQUEUE + _FAIR + """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'processing' then return 0 end
close_open(KEYS[1], ARGV[3])
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'updated_at', ARGV[1],
           'finished_at', ARGV[1], 'error', '')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[2])
return 1
"""

# --- the worker's transitions (lanes.queue) -------------------------------------------

_PRELUDE = _ENQUEUE + _FAIR + SCHEDULE_WEBHOOK_LUA + """
local function drop(stream, group, entry)
  redis.call('XACK', stream, group, entry)
  redis.call('XDEL', stream, entry)
end
local function owns(job, attempt)
  return redis.call('HGET', job, 'status') == 'processing'
     and redis.call('HGET', job, 'attempts') == attempt
end
-- a retried call whose first run landed but whose reply was lost (a connection dropped
-- in a failover): the same answer again, not "no longer ours"
local function already(job, status, attempt)
  return redis.call('HGET', job, 'status') == status
     and redis.call('HGET', job, 'attempts') == attempt
end
-- a worker that no longer owns the job: a cancelled job's entry is dropped all the same
local function lost(job, stream, group, entry)
  if redis.call('HGET', job, 'status') == 'cancelled' then drop(stream, group, entry) end
  return 0
end
local function finish(job, status, now, ttl, err, wh_due, wh_key, job_id)
  close_open(job, job_id)
  redis.call('HSET', job, 'status', status, 'updated_at', now, 'finished_at', now,
             'error', err)
  if status == 'completed' then redis.call('HSET', job, 'progress', '1') end
  redis.call('PEXPIRE', job, ttl)
  local url = redis.call('HGET', job, 'webhook_url')
  if url and url ~= '' then schedule_webhook(wh_key, wh_due, job_id, url, status, now, ttl) end
end
"""
# Every script: KEYS = job, result, stream, dead, webhook_due, webhook
#               ARGV = group, entry, job_id, now, job_ttl_ms, <script args>

START = _PRELUDE + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then drop(KEYS[3], ARGV[1], ARGV[2]); return {'skip', 'gone'} end
if status ~= 'queued' and status ~= 'processing' then
  drop(KEYS[3], ARGV[1], ARGV[2]); return {'skip', status}
end
if redis.call('HGET', KEYS[1], 'entry') ~= ARGV[2] then
  drop(KEYS[3], ARGV[1], ARGV[2]); return {'skip', 'stale'}
end
local attempts = tonumber(redis.call('HGET', KEYS[1], 'attempts') or '0')
if attempts >= tonumber(ARGV[7]) then
  local last = redis.call('HGET', KEYS[1], 'last_error')
  if not last or last == '' then last = 'the worker stopped during every attempt' end
  local reason = 'gave up after ' .. attempts .. ' attempts: ' .. last
  finish(KEYS[1], 'failed', ARGV[4], ARGV[5], reason, KEYS[5], KEYS[6], ARGV[3])
  redis.call('XADD', KEYS[4], '*', 'job_id', ARGV[3], 'entry', ARGV[2],
             'tenant', redis.call('HGET', KEYS[1], 'tenant') or '',
             'attempts', tostring(attempts), 'reason', reason, 'failed_at', ARGV[4])
  drop(KEYS[3], ARGV[1], ARGV[2])
  return {'dead', reason}
end
attempts = attempts + 1
local started = redis.call('HGET', KEYS[1], 'started_at')
local first = (not started) or started == ''
if first then redis.call('HSET', KEYS[1], 'started_at', ARGV[4]) end
redis.call('HSET', KEYS[1], 'status', 'processing', 'attempts', tostring(attempts),
           'worker', ARGV[6], 'updated_at', ARGV[4], 'progress', '0', 'partial_text', '')
if first then return {'run', tostring(attempts), '1'} end
return {'run', tostring(attempts), '0'}
"""

PROGRESS = _PRELUDE + """
if not owns(KEYS[1], ARGV[6]) then return 0 end
redis.call('HSET', KEYS[1], 'progress', ARGV[7], 'partial_text', ARGV[8],
           'updated_at', ARGV[4])
return 1
"""

COMPLETE = _PRELUDE + """
if already(KEYS[1], 'completed', ARGV[6]) then drop(KEYS[3], ARGV[1], ARGV[2]); return 1 end
if not owns(KEYS[1], ARGV[6]) then return lost(KEYS[1], KEYS[3], ARGV[1], ARGV[2]) end
redis.call('SET', KEYS[2], ARGV[7], 'PX', ARGV[5], 'NX')
-- no language was asked for: the job reports the one its result was decoded in
if redis.call('HGET', KEYS[1], 'language') == '' then
  redis.call('HSET', KEYS[1], 'language', ARGV[8])
end
finish(KEYS[1], 'completed', ARGV[4], ARGV[5], '', KEYS[5], KEYS[6], ARGV[3])
drop(KEYS[3], ARGV[1], ARGV[2])
return 1
"""

FAIL = _PRELUDE + """
if already(KEYS[1], 'failed', ARGV[6]) then drop(KEYS[3], ARGV[1], ARGV[2]); return 1 end
if not owns(KEYS[1], ARGV[6]) then return lost(KEYS[1], KEYS[3], ARGV[1], ARGV[2]) end
finish(KEYS[1], 'failed', ARGV[4], ARGV[5], ARGV[7], KEYS[5], KEYS[6], ARGV[3])
drop(KEYS[3], ARGV[1], ARGV[2])
return 1
"""

RELEASE = _PRELUDE + """
if not owns(KEYS[1], ARGV[6]) then return 0 end
local attempts = tonumber(redis.call('HGET', KEYS[1], 'attempts'))
if ARGV[7] == '0' then attempts = attempts - 1 end
local entry = enqueue(KEYS[3], ARGV[3], redis.call('HGET', KEYS[1], 'tenant') or '', ARGV[4])
redis.call('HSET', KEYS[1], 'status', 'queued', 'attempts', tostring(attempts),
           'progress', '0', 'partial_text', '', 'entry', entry, 'worker', '',
           'updated_at', ARGV[4])
if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'last_error', ARGV[8]) end
drop(KEYS[3], ARGV[1], ARGV[2])
return 1
"""

DROP = _PRELUDE + """
drop(KEYS[3], ARGV[1], ARGV[2])
return 1
"""

# KEYS = stream, ring   ARGV = group, window, now
FEED = _ENQUEUE + _FAIR + """
return feed(KEYS[1], ARGV[1], KEYS[2], ARGV[2], ARGV[3])
"""

# KEYS = stream; ARGV = group, consumer, entry ids...
TOUCH = """
local owned = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    owned[#owned + 1] = ARGV[i]
  end
end
return owned
"""

#: the worker scripts by name, as ``JobQueue`` registers them
TRANSITIONS = {"start": START, "progress": PROGRESS, "complete": COMPLETE, "fail": FAIL,
               "release": RELEASE, "drop": DROP, "touch": TOUCH, "feed": FEED}
