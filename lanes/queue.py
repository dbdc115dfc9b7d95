"""The worker side of the batch lane: stream mechanics and job transitions.

One consumer group (``JOB_GROUP``) reads ``JOB_STREAM``. A worker owns a job
for one *attempt*: ``start`` bumps the job's ``attempts`` and every later write
(progress, result, failure, hand-back) is accepted only while the job is still
``processing`` with that same attempt number. So when a slow or dead worker's
entry is reclaimed (``XAUTOCLAIM`` after ``claim_idle_s``) and started by
another worker, the old owner's writes are refused: one result per job.

Every transition is one Lua script that changes the job hash, the stream
(``XACK`` + ``XDEL``: a finished entry leaves the stream), the dead-letter
stream and the webhook queue together. The result is written with ``SET NX``
before the entry is acknowledged.

A live worker keeps its entries from being reclaimed with ``touch``
(``XCLAIM ... JUSTID`` resets their idle time, only for entries it still owns).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ResponseError

from lanegate.constants import (
    DEAD_LETTER_STREAM,
    JOB_GROUP,
    JOB_KEY,
    JOB_STREAM,
    RESULT_KEY,
    WEBHOOK_DUE_KEY,
    WEBHOOK_KEY,
)
from lanegate.settings import Settings
from lanegate.transcript import Transcript
from lanes.jobs import Job, decode_hash

#: most XAUTOCLAIM calls one ``reclaim`` makes while scanning the pending list
_RECLAIM_SCAN_CALLS = 100

_PRELUDE = """
local function drop(stream, group, entry)
  redis.call('XACK', stream, group, entry)
  redis.call('XDEL', stream, entry)
end
local function owns(job, attempt)
  return redis.call('HGET', job, 'status') == 'processing'
     and redis.call('HGET', job, 'attempts') == attempt
end
-- a worker that no longer owns the job: a cancelled job's entry is dropped all the same
local function lost(job, stream, group, entry)
  if redis.call('HGET', job, 'status') == 'cancelled' then drop(stream, group, entry) end
  return 0
end
local function finish(job, status, now, ttl, err, wh_due, wh_key, job_id)
  redis.call('HSET', job, 'status', status, 'updated_at', now, 'finished_at', now,
             'error', err)
  if status == 'completed' then redis.call('HSET', job, 'progress', '1') end
  redis.call('PEXPIRE', job, ttl)
  local url = redis.call('HGET', job, 'webhook_url')
  if url and url ~= '' then
    redis.call('HSET', wh_key, 'job_id', job_id, 'url', url, 'status', status,
               'attempts', '0')
    redis.call('PEXPIRE', wh_key, ttl)
    redis.call('ZADD', wh_due, now, job_id)
  end
end
"""
# Every script: KEYS = job, result, stream, dead, webhook_due, webhook
#               ARGV = group, entry, job_id, now, job_ttl_ms, <script args>

_START = _PRELUDE + """
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
           'worker', ARGV[6], 'updated_at', ARGV[4], 'progress', '0')
if first then return {'run', tostring(attempts), '1'} end
return {'run', tostring(attempts), '0'}
"""

_PROGRESS = _PRELUDE + """
if not owns(KEYS[1], ARGV[6]) then return 0 end
redis.call('HSET', KEYS[1], 'progress', ARGV[7], 'updated_at', ARGV[4])
return 1
"""

_COMPLETE = _PRELUDE + """
if not owns(KEYS[1], ARGV[6]) then return lost(KEYS[1], KEYS[3], ARGV[1], ARGV[2]) end
redis.call('SET', KEYS[2], ARGV[7], 'PX', ARGV[5], 'NX')
finish(KEYS[1], 'completed', ARGV[4], ARGV[5], '', KEYS[5], KEYS[6], ARGV[3])
drop(KEYS[3], ARGV[1], ARGV[2])
return 1
"""

_FAIL = _PRELUDE + """
if not owns(KEYS[1], ARGV[6]) then return lost(KEYS[1], KEYS[3], ARGV[1], ARGV[2]) end
finish(KEYS[1], 'failed', ARGV[4], ARGV[5], ARGV[7], KEYS[5], KEYS[6], ARGV[3])
drop(KEYS[3], ARGV[1], ARGV[2])
return 1
"""

_RELEASE = _PRELUDE + """
if not owns(KEYS[1], ARGV[6]) then return 0 end
local attempts = tonumber(redis.call('HGET', KEYS[1], 'attempts'))
if ARGV[7] == '0' then attempts = attempts - 1 end
local entry = redis.call('XADD', KEYS[3], '*', 'job_id', ARGV[3],
                         'tenant', redis.call('HGET', KEYS[1], 'tenant') or '',
                         'enqueued_at', ARGV[4])
redis.call('HSET', KEYS[1], 'status', 'queued', 'attempts', tostring(attempts),
           'progress', '0', 'entry', entry, 'worker', '', 'updated_at', ARGV[4])
if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'last_error', ARGV[8]) end
drop(KEYS[3], ARGV[1], ARGV[2])
return 1
"""

_DROP = _PRELUDE + """
drop(KEYS[3], ARGV[1], ARGV[2])
return 1
"""

# KEYS = stream; ARGV = group, consumer, entry ids...
_TOUCH = """
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


def redis_client(url: str) -> aioredis.Redis:
    """A client that retries a command a few times on a dropped connection.

    ``Redis.from_url`` in redis-py 8 gives its connections no retries, so the
    first command on a pooled connection after a Redis restart fails; with
    these retries it reconnects instead. Longer outages still raise
    ``ConnectionError`` (the worker waits them out with backoff).
    """
    return aioredis.Redis.from_url(
        url, socket_connect_timeout=2.0, socket_timeout=10.0, health_check_interval=5,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
    )


@dataclass(frozen=True)
class Delivery:
    """One stream entry handed to this worker."""

    entry_id: str
    job_id: str
    tenant: str
    enqueued_at: float


@dataclass(frozen=True)
class Started:
    """What ``start`` decided: ``run`` (with the attempt number), ``skip``
    (cancelled, finished, expired or superseded: the entry was dropped) or
    ``dead`` (out of attempts: dead-lettered and failed)."""

    outcome: str
    attempt: int = 0
    first: bool = False  # the job's first start (queue wait ends here)
    reason: str = ""
    job: Job | None = None


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _entries(reply: Any) -> list[tuple[str, dict[str, str] | None]]:
    """(id, fields) pairs of an XREADGROUP / XAUTOCLAIM reply (RESP2 or RESP3)."""
    out: list[tuple[str, dict[str, str] | None]] = []
    for entry_id, fields in reply or []:
        out.append((_s(entry_id), decode_hash(fields) if fields else None))
    return out


def _streams(reply: Any) -> list[Any]:
    if isinstance(reply, dict):
        return [entries for entries in reply.values()]
    return [entries for _, entries in reply or []]


class JobQueue:
    """A batch worker's handle on the job stream, as consumer ``consumer``."""

    def __init__(self, redis: aioredis.Redis, settings: Settings, consumer: str) -> None:
        self.redis = redis
        self.settings = settings
        self.consumer = consumer
        self._autoclaim_cursor = "0-0"
        self._scripts = {
            name: redis.register_script(src)
            for name, src in (("start", _START), ("progress", _PROGRESS),
                              ("complete", _COMPLETE), ("fail", _FAIL),
                              ("release", _RELEASE), ("drop", _DROP), ("touch", _TOUCH))
        }

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream) if missing: reads from id 0."""
        try:
            await self.redis.xgroup_create(JOB_STREAM, JOB_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # --- getting entries ----------------------------------------------------------

    async def read(self, count: int = 1, block_ms: int | None = None) -> list[Delivery]:
        """New entries (``>``); blocks up to ``block_ms`` when given."""
        reply = await self.redis.xreadgroup(
            JOB_GROUP, self.consumer, {JOB_STREAM: ">"}, count=count, block=block_ms
        )
        return await self._deliveries(
            [e for entries in _streams(reply) for e in _entries(entries)]
        )

    async def read_own_pending(self, count: int = 100) -> list[Delivery]:
        """Entries already pending for this consumer name (a restarted worker's)."""
        reply = await self.redis.xreadgroup(
            JOB_GROUP, self.consumer, {JOB_STREAM: "0"}, count=count
        )
        return await self._deliveries(
            [e for entries in _streams(reply) for e in _entries(entries)]
        )

    async def reclaim(self, count: int = 1) -> list[Delivery]:
        """Entries idle for ``claim_idle_s`` in any consumer (a dead worker's).

        Scans the whole pending list if need be (XAUTOCLAIM looks at about
        ``10 x count`` entries per call) and remembers where it stopped."""
        for _ in range(_RECLAIM_SCAN_CALLS):
            reply = await self.redis.xautoclaim(
                JOB_STREAM, JOB_GROUP, self.consumer,
                min_idle_time=int(self.settings.claim_idle_s * 1000),
                start_id=self._autoclaim_cursor, count=count,
            )
            self._autoclaim_cursor = _s(reply[0])
            found = await self._deliveries(_entries(reply[1]))
            if found or self._autoclaim_cursor == "0-0":
                return found
        return []

    async def _deliveries(
        self, entries: list[tuple[str, dict[str, str] | None]]
    ) -> list[Delivery]:
        out: list[Delivery] = []
        for entry_id, fields in entries:
            if not fields or "job_id" not in fields:  # deleted under us: forget it
                await self.redis.xack(JOB_STREAM, JOB_GROUP, entry_id)
                continue
            out.append(Delivery(entry_id, fields["job_id"], fields.get("tenant", ""),
                                float(fields.get("enqueued_at") or 0.0)))
        return out

    async def touch(self, entry_ids: list[str]) -> set[str]:
        """Reset the idle time of the entries this consumer still owns; returns them."""
        if not entry_ids:
            return set()
        owned = await self._scripts["touch"](
            keys=[JOB_STREAM], args=[JOB_GROUP, self.consumer, *entry_ids]
        )
        return {_s(e) for e in owned}

    # --- transitions --------------------------------------------------------------

    async def start(self, d: Delivery) -> Started:
        reply = await self._run("start", d, self.consumer, self.settings.max_attempts)
        outcome = _s(reply[0])
        if outcome == "run":
            job = await self.job(d.job_id)
            return Started("run", int(_s(reply[1])), _s(reply[2]) == "1", job=job)
        return Started(outcome, reason=_s(reply[1]))

    async def progress(self, d: Delivery, attempt: int, progress: float) -> bool:
        return bool(await self._run("progress", d, attempt, f"{progress:.4f}"))

    async def complete(self, d: Delivery, attempt: int, transcript: Transcript) -> bool:
        """Store the result (SET NX) and acknowledge; False if no longer ours."""
        return bool(await self._run("complete", d, attempt, transcript.to_json()))

    async def fail(self, d: Delivery, attempt: int, reason: str) -> bool:
        """Fail the job now (no retry) and acknowledge; False if no longer ours."""
        return bool(await self._run("fail", d, attempt, reason))

    async def release(self, d: Delivery, attempt: int, *, count_attempt: bool,
                      error: str = "") -> bool:
        """Hand the job back: re-queued on a new entry, this one acknowledged.
        ``count_attempt=False`` (a clean shutdown) gives the attempt back."""
        return bool(await self._run("release", d, attempt,
                                    "1" if count_attempt else "0", error))

    async def drop(self, d: Delivery) -> None:
        """Acknowledge and delete an entry whose job needs no more work."""
        await self._run("drop", d)

    async def states(self, owned: dict[str, int]) -> dict[str, str]:
        """For job id -> attempt: ``ok``, ``cancelled`` or ``lost`` (another
        attempt owns it, it finished elsewhere, or it expired)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in owned:
                pipe.hmget(JOB_KEY.format(job_id=job_id), ["status", "attempts"])
            replies = await pipe.execute()
        out: dict[str, str] = {}
        for (job_id, attempt), (status, attempts) in zip(owned.items(), replies, strict=True):
            status_s = _s(status) if status is not None else ""
            if status_s == "cancelled":
                out[job_id] = "cancelled"
            elif status_s == "processing" and attempts is not None \
                    and int(_s(attempts)) == attempt:
                out[job_id] = "ok"
            else:
                out[job_id] = "lost"
        return out

    async def job(self, job_id: str) -> Job | None:
        raw = decode_hash(await self.redis.hgetall(JOB_KEY.format(job_id=job_id)))
        return Job.from_hash(raw) if raw else None

    async def _run(self, script: str, d: Delivery, *extra: object) -> Any:
        keys = [JOB_KEY.format(job_id=d.job_id), RESULT_KEY.format(job_id=d.job_id),
                JOB_STREAM, DEAD_LETTER_STREAM, WEBHOOK_DUE_KEY,
                WEBHOOK_KEY.format(job_id=d.job_id)]
        args = [JOB_GROUP, d.entry_id, d.job_id, repr(time.time()),
                str(max(1, int(self.settings.job_ttl_s * 1000))), *[str(x) for x in extra]]
        return await self._scripts[script](keys=keys, args=args)
