"""Batch jobs: the gateway's side of the batch lane's job store in Redis.

A job is a hash at ``JOB_KEY`` (expires ``job_ttl_s`` after its last transition),
listed per tenant in the sorted set ``TENANT_JOBS_KEY`` (scored by creation
time) and queued as one entry on ``JOB_STREAM``, which it joins fairly: each
tenant's jobs wait in their own list and join the stream round-robin across
tenants (``lanes.job_protocol``: ``feed``); unfinished jobs count against the
tenant's quotas (``TENANT_OPEN_KEY``). Its audio is
``BlobStore(settings.blob_path).path(job_id, "audio.pcm")`` (16 kHz s16le mono,
written by the gateway before ``submit``); its result is Transcript JSON at
``RESULT_KEY``. The hash, the entry, the statuses and the scripts are
``lanes.job_protocol``; workers drive the state machine through ``lanes.queue``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from typing import Any

import redis.asyncio as aioredis

from engines.base import Task
from lanegate.blobs import BlobError, BlobStore
from lanegate.constants import (
    FAIR_RING_KEY,
    FAIR_WAITING_KEY,
    IDEMPOTENCY_KEY,
    JOB_GROUP,
    JOB_KEY,
    JOB_STREAM,
    RESULT_KEY,
    TENANT_JOBS_KEY,
    TENANT_OPEN_KEY,
)
from lanegate.redis_io import decode_hash, text, ttl_ms
from lanegate.settings import Settings
from lanegate.transcript import Transcript
from lanes.job_protocol import CANCEL, SUBMIT, Job, JobStatus, Quota, new_job_hash

#: wait(): first poll interval and the cap it grows to
_WAIT_POLL_S = 0.05
_WAIT_POLL_MAX_S = 0.5


class JobNotFound(KeyError):
    """The job does not exist (or expired, or belongs to another tenant)."""


#: what a refused submit suggests as ``Retry-After``: jobs finish in about this long
QUOTA_RETRY_AFTER_S = 60


class QuotaExceeded(Exception):
    """The tenant's unfinished jobs are at ``max_queued_jobs_per_key`` or this job would
    pass ``max_queued_audio_hours_per_key``; nothing was queued."""

    def __init__(self, quota: Quota, settings: Settings) -> None:
        self.quota = quota
        self.retry_after_s = QUOTA_RETRY_AFTER_S
        if quota is Quota.JOBS:
            message = (f"this key has {settings.max_queued_jobs_per_key} unfinished jobs "
                       "(max_queued_jobs_per_key)")
        else:
            message = (f"this job would pass {settings.max_queued_audio_hours_per_key:g} "
                       "audio hours of unfinished jobs for this key "
                       "(max_queued_audio_hours_per_key)")
        super().__init__(f"{message}; retry when some have finished")


class JobStore:
    """The gateway's view of batch jobs (workers use ``lanes.queue.JobQueue``)."""

    def __init__(self, redis: aioredis.Redis, settings: Settings) -> None:
        self.redis = redis
        self.settings = settings
        self.blobs = BlobStore(settings.blob_path)
        self._submit = redis.register_script(SUBMIT)
        self._cancel = redis.register_script(CANCEL)

    # --- writes -------------------------------------------------------------------

    async def submit(
        self, *, job_id: str, tenant: str, audio_seconds: float, language: str = "",
        response_format: str = "json", webhook_url: str | None = None,
        filename: str | None = None, idempotency_key: str | None = None,
        prompt: str = "", temperature: float | None = None,
        task: Task = Task.TRANSCRIBE,
    ) -> tuple[Job, bool]:
        """Queue the job whose audio blob ``job_id`` the caller has written.

        An empty ``language`` is detected by the engine (the result reports it);
        ``prompt`` and ``temperature`` (None: the engine's default) condition its decoder;
        ``task`` TRANSLATE asks for English text (Whisper's translate task).
        Returns ``(job, created)``. The same ``tenant`` + ``idempotency_key``
        within ``idempotency_ttl_s`` returns the first job with ``created=False``
        (the check and the write are one script, so two racing requests make one
        job); the caller should then delete its own, unused blob. Raises
        ``QuotaExceeded`` (checked in the same script) past the key's quotas.
        """
        self.blobs.dir(job_id)  # validates the id: server-generated hex only
        for _ in range(2):
            job_ref, created = await self._submit_once(
                job_id=job_id, tenant=tenant, audio_seconds=audio_seconds, language=language,
                response_format=response_format, webhook_url=webhook_url,
                filename=filename, idempotency_key=idempotency_key,
                prompt=prompt, temperature=temperature, task=task,
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
        idempotency_key: str | None, prompt: str, temperature: float | None,
        task: Task,
    ) -> tuple[str, bool]:
        now = time.time()
        fields = new_job_hash(job_id=job_id, tenant=tenant, now=now,
                              audio_seconds=audio_seconds, language=language,
                              response_format=response_format, webhook_url=webhook_url,
                              filename=filename, prompt=prompt, temperature=temperature,
                              task=task)
        flat = [item for pair in fields.items() for item in pair]
        use_idem = idempotency_key is not None
        keys = [
            JOB_KEY.format(job_id=job_id), TENANT_JOBS_KEY.format(tenant=tenant), JOB_STREAM,
            self._idem_key(tenant, idempotency_key or ""), TENANT_OPEN_KEY.format(tenant=tenant),
            FAIR_RING_KEY, FAIR_WAITING_KEY.format(tenant=tenant),
        ]
        s = self.settings
        args = [
            job_id, "1" if use_idem else "0", ttl_ms(s.idempotency_ttl_s),
            ttl_ms(s.job_ttl_s), repr(now), tenant, JOB_GROUP, max(1, s.batch_fair_window),
            s.max_queued_jobs_per_key, repr(s.max_queued_audio_hours_per_key * 3600.0),
            repr(float(audio_seconds)), *flat,
        ]
        reply = await self._submit(keys=keys, args=args)
        if int(reply[1]) < 0:
            raise QuotaExceeded(Quota(text(reply[2])), s)
        return text(reply[0]), bool(int(reply[1]))

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
            keys=[JOB_KEY.format(job_id=job_id), RESULT_KEY.format(job_id=job_id)],
            args=[repr(time.time()), ttl_ms(self.settings.job_ttl_s), job_id],
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
        if job is None or job.status is not JobStatus.COMPLETED:
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
        rows = [(text(m), float(score)) for m, score in members]
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


def _make_cursor(job_id: str, score: float) -> str:
    return f"{score!r}:{job_id}"


def _parse_cursor(cursor: str | None) -> tuple[str, str | None]:
    """(max score for ZRANGE, id to continue after); ``+inf`` when no cursor."""
    if not cursor:
        return "+inf", None
    score, _, job_id = cursor.partition(":")
    try:
        finite = math.isfinite(float(score))
    except ValueError:
        finite = False
    if not finite:  # nan / inf would reach Redis as a bad range
        raise ValueError(f"bad cursor: {cursor!r}")
    return score, job_id or None
