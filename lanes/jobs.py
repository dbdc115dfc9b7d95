"""Batch jobs: the public side of the batch lane's job store in Redis.

A job is a hash at ``JOB_KEY`` (expires ``job_ttl_s`` after its last transition),
listed per tenant in the sorted set ``TENANT_JOBS_KEY`` (scored by creation
time) and queued as one entry ``{job_id, tenant}`` on ``JOB_STREAM``. Its audio
is ``BlobStore(settings.blob_path).path(job_id, "audio.pcm")`` (16 kHz s16le
mono, written by the gateway before ``submit``); its result is Transcript JSON
at ``RESULT_KEY``. Workers drive the state machine through ``lanes.queue``.

Statuses: ``queued -> processing -> completed | failed``; ``queued | processing
-> cancelled``; a processing job whose worker hands it back goes to ``queued``.
Every multi-key change is one Lua script, so a job is never half-written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from lanegate.blobs import BlobError, BlobStore
from lanegate.constants import (
    CANCEL_KEY,
    IDEMPOTENCY_KEY,
    JOB_KEY,
    JOB_STREAM,
    RESULT_KEY,
    TENANT_JOBS_KEY,
)
from lanegate.settings import Settings
from lanegate.transcript import Transcript

JOB_STATUSES = ("queued", "processing", "completed", "failed", "cancelled")
TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled"})
ACTIVE_STATUSES = frozenset({"queued", "processing"})

#: wait(): first poll interval and the cap it grows to
_WAIT_POLL_S = 0.05
_WAIT_POLL_MAX_S = 0.5


class JobNotFound(KeyError):
    """The job does not exist (or expired, or belongs to another tenant)."""


def _opt_float(raw: str) -> float | None:
    return float(raw) if raw else None


def _opt_str(raw: str) -> str | None:
    return raw or None


@dataclass(frozen=True)
class Job:
    id: str
    tenant: str
    status: str
    created_at: float  # epoch seconds
    updated_at: float
    started_at: float | None  # first time a worker began processing it
    finished_at: float | None  # when it reached a terminal status
    audio_seconds: float
    progress: float  # 0..1: audio decoded / audio total
    attempts: int  # deliveries to a worker so far
    error: str | None
    language: str
    response_format: str
    webhook_url: str | None
    filename: str | None
    worker: str | None = None  # the worker processing it (or that last did)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

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
            status=raw["status"],
            created_at=float(raw["created_at"]),
            updated_at=float(raw.get("updated_at") or raw["created_at"]),
            started_at=_opt_float(raw.get("started_at", "")),
            finished_at=_opt_float(raw.get("finished_at", "")),
            audio_seconds=float(raw.get("audio_seconds") or 0.0),
            progress=float(raw.get("progress") or 0.0),
            attempts=int(raw.get("attempts") or 0),
            error=_opt_str(raw.get("error", "")),
            language=raw.get("language") or "en",
            response_format=raw.get("response_format") or "json",
            webhook_url=_opt_str(raw.get("webhook_url", "")),
            filename=_opt_str(raw.get("filename", "")),
            worker=_opt_str(raw.get("worker", "")),
        )


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def decode_hash(raw: dict[Any, Any]) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in raw.items()}


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# KEYS: job, tenant_jobs, stream, idem
# ARGV: job_id, use_idem, idem_ttl_ms, job_ttl_ms, now, tenant, field/value pairs...
_SUBMIT = """
if ARGV[2] == '1' then
  local existing = redis.call('GET', KEYS[4])
  if existing then return {existing, 0} end
end
if redis.call('EXISTS', KEYS[1]) == 1 then return {ARGV[1], 0} end
local fields = {}
for i = 7, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
local entry = redis.call('XADD', KEYS[3], '*', 'job_id', ARGV[1], 'tenant', ARGV[6],
                         'enqueued_at', ARGV[5])
redis.call('HSET', KEYS[1], 'entry', entry)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
if ARGV[2] == '1' then redis.call('SET', KEYS[4], ARGV[1], 'PX', ARGV[3]) end
return {ARGV[1], 1}
"""

# KEYS: job, result, cancel   ARGV: now, job_ttl_ms, cancel_ttl_ms
_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'processing' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'updated_at', ARGV[1],
           'finished_at', ARGV[1], 'error', '')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[3])
return 1
"""


class JobStore:
    """The gateway's view of batch jobs (workers use ``lanes.queue.JobQueue``)."""

    def __init__(self, redis: aioredis.Redis, settings: Settings) -> None:
        self.redis = redis
        self.settings = settings
        self.blobs = BlobStore(settings.blob_path)
        self._submit = redis.register_script(_SUBMIT)
        self._cancel = redis.register_script(_CANCEL)

    # --- writes -------------------------------------------------------------------

    async def submit(
        self, *, job_id: str, tenant: str, audio_seconds: float, language: str = "en",
        response_format: str = "json", webhook_url: str | None = None,
        filename: str | None = None, idempotency_key: str | None = None,
    ) -> tuple[Job, bool]:
        """Queue the job whose audio blob ``job_id`` the caller has written.

        Returns ``(job, created)``. The same ``tenant`` + ``idempotency_key``
        within ``idempotency_ttl_s`` returns the first job with ``created=False``
        (the check and the write are one script, so two racing requests make one
        job); the caller should then delete its own, unused blob.
        """
        self.blobs.dir(job_id)  # validates the id: server-generated hex only
        for _ in range(2):
            job_ref, created = await self._submit_once(
                job_id=job_id, tenant=tenant, audio_seconds=audio_seconds, language=language,
                response_format=response_format, webhook_url=webhook_url,
                filename=filename, idempotency_key=idempotency_key,
            )
            job = await self.get(job_ref, tenant)
            if job is not None:
                return job, created
            if idempotency_key is not None:  # the key outlived its job: forget it
                await self.redis.delete(self._idem_key(tenant, idempotency_key))
        raise JobNotFound(job_id)

    async def _submit_once(
        self, *, job_id: str, tenant: str, audio_seconds: float, language: str,
        response_format: str, webhook_url: str | None, filename: str | None,
        idempotency_key: str | None,
    ) -> tuple[str, bool]:
        now = time.time()
        fields = {
            "id": job_id, "tenant": tenant, "status": "queued", "created_at": repr(now),
            "updated_at": repr(now), "started_at": "", "finished_at": "",
            "audio_seconds": repr(float(audio_seconds)), "progress": "0", "attempts": "0",
            "error": "", "language": language, "response_format": response_format,
            "webhook_url": webhook_url or "", "filename": filename or "", "worker": "",
        }
        flat = [item for pair in fields.items() for item in pair]
        use_idem = idempotency_key is not None
        keys = [
            JOB_KEY.format(job_id=job_id), TENANT_JOBS_KEY.format(tenant=tenant), JOB_STREAM,
            self._idem_key(tenant, idempotency_key or ""),
        ]
        args = [
            job_id, "1" if use_idem else "0", _ms_int(self.settings.idempotency_ttl_s),
            _ms_int(self.settings.job_ttl_s), repr(now), tenant, *flat,
        ]
        ref, created = await self._submit(keys=keys, args=args)
        return _s(ref), bool(int(created))

    async def cancel(self, job_id: str, tenant: str) -> Job | None:
        """Cancel a queued or processing job and delete its audio and result.

        Returns the job after the call (``cancelled``, or unchanged if it had
        already finished), or None if the tenant has no such job. A worker
        processing it notices between two batches and stops.
        """
        job = await self.get(job_id, tenant)
        if job is None:
            return None
        cancelled = await self._cancel(
            keys=[JOB_KEY.format(job_id=job_id), RESULT_KEY.format(job_id=job_id),
                  CANCEL_KEY.format(job_id=job_id)],
            args=[repr(time.time()), _ms_int(self.settings.job_ttl_s),
                  _ms_int(self.settings.job_ttl_s)],
        )
        if int(cancelled):
            self.delete_audio(job_id)
        return await self.get(job_id, tenant)

    def delete_audio(self, job_id: str) -> None:
        with contextlib.suppress(BlobError):
            self.blobs.delete(job_id)

    # --- reads --------------------------------------------------------------------

    async def get(self, job_id: str, tenant: str) -> Job | None:
        """The job, or None if it does not exist or belongs to another tenant."""
        raw = decode_hash(await self.redis.hgetall(JOB_KEY.format(job_id=job_id)))
        if not raw or raw.get("tenant") != tenant:
            return None
        return Job.from_hash(raw)

    async def result(self, job_id: str, tenant: str) -> Transcript | None:
        """The stored transcript of a completed job of this tenant, else None."""
        job = await self.get(job_id, tenant)
        if job is None or job.status != "completed":
            return None
        raw = await self.redis.get(RESULT_KEY.format(job_id=job_id))
        if raw is None:
            return None
        return Transcript.from_dict(json.loads(raw))

    async def list_jobs(
        self, tenant: str, *, limit: int = 20, cursor: str | None = None
    ) -> tuple[list[Job], str | None]:
        """The tenant's jobs, newest first, at most ``limit``; and the cursor of
        the next page (None on the last page). Pass the cursor back unchanged;
        a malformed cursor raises ValueError."""
        limit = max(1, limit)
        key = TENANT_JOBS_KEY.format(tenant=tenant)
        bound, after = _parse_cursor(cursor)
        ties = 0 if after is None else int(await self.redis.zcount(key, bound, bound))
        members: Any = await self.redis.zrange(
            key, bound, "-inf", desc=True, byscore=True, withscores=True,
            offset=0, num=limit + ties + 1,
        )
        rows = [(_s(m), float(score)) for m, score in members]
        if after is not None:
            rows = [(m, sc) for m, sc in rows if not (sc == float(bound) and m >= after)]
        page, more = rows[:limit], len(rows) > limit
        jobs = await self._load(key, [m for m, _ in page], tenant)
        next_cursor = _make_cursor(page[-1][0], page[-1][1]) if more and page else None
        return jobs, next_cursor

    async def _load(self, key: str, ids: list[str], tenant: str) -> list[Job]:
        jobs: list[Job] = []
        gone: list[str] = []
        for job_id in ids:
            job = await self.get(job_id, tenant)
            if job is None:
                gone.append(job_id)
            else:
                jobs.append(job)
        if gone:  # expired jobs leave their index entry behind
            await self.redis.zrem(key, *gone)
        return jobs

    async def wait(self, job_id: str, tenant: str, *, timeout_s: float) -> Job:
        """Poll until the job is terminal or ``timeout_s`` passed; returns the job
        as it is then. Raises JobNotFound if it does not exist (or vanishes)."""
        deadline = time.monotonic() + timeout_s
        delay = _WAIT_POLL_S
        while True:
            job = await self.get(job_id, tenant)
            if job is None:
                raise JobNotFound(job_id)
            left = deadline - time.monotonic()
            if job.terminal or left <= 0:
                return job
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, _WAIT_POLL_MAX_S)

    @staticmethod
    def _idem_key(tenant: str, key: str) -> str:
        return IDEMPOTENCY_KEY.format(tenant=tenant, key=key)


def _ms_int(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _make_cursor(job_id: str, score: float) -> str:
    return f"{score!r}:{job_id}"


def _parse_cursor(cursor: str | None) -> tuple[str, str | None]:
    """(max score for ZRANGE, id to continue after); ``+inf`` when no cursor."""
    if not cursor:
        return "+inf", None
    score, _, job_id = cursor.partition(":")
    try:
        float(score)
    except ValueError:
        raise ValueError(f"bad cursor: {cursor!r}") from None
    return score, job_id or None
