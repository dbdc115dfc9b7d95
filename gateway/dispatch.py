"""Serving an upload, for both upload endpoints: receive, decode, then realtime or a job.

:func:`take_upload` receives and decodes the body, parsing the endpoint's options
in between. :func:`serve_upload` asks ``lanes.routing.route_upload`` for the lane
and serves it: the realtime lane when the route says so, and a batch job when it
does not or when the realtime lane refuses the session once asked.
:func:`wait_for_job` is the OpenAI endpoint's wait for a job's transcript.
The endpoints only parse their options and render what comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web

from engines.base import Task
from gateway.intake import Upload, UploadError, decode, receive
from gateway.realtime_upload import (
    OnSegment,
    RealtimeFailed,
    RealtimeUnavailable,
    transcribe_realtime,
)
from gateway.state import JOBS, REDIS, SETTINGS, UPLOAD_POOL
from lanegate.audio import DecodedAudio
from lanegate.logs import get_logger
from lanegate.metrics import JOBS as JOBS_TOTAL
from lanegate.transcript import Transcript
from lanes.job_protocol import Job
from lanes.jobs import JobNotFound, QuotaExceeded
from lanes.registry import list_workers
from lanes.routing import Lane, Reason, Route, busy_fallback, route_upload, wait_timeout_s

log = get_logger("gateway.dispatch")

T = TypeVar("T")

#: how often a streamed transcription polls its job's progress
FOLLOW_POLL_S = 0.25


@dataclass(frozen=True)
class UploadAsk:
    """What the caller asked for, as parsed by its endpoint."""

    tenant: str
    language: str  # "": the engine detects it
    response_format: str = "json"
    async_requested: bool = False
    webhook_url: str | None = None
    idempotency_key: str | None = None
    #: whose realtime sessions a realtime-lane answer counts against (``tenant`` when
    #: empty; the client's address with auth off: ``gateway.auth.lease_subject``)
    subject: str = ""
    prompt: str = ""  # conditions the decoder (Whisper's initial prompt)
    temperature: float | None = None  # None: the engine's default (greedy)
    task: Task = Task.TRANSCRIBE  # TRANSLATE: English text (Whisper's translate task)


@dataclass(frozen=True)
class Transcribed:
    """Served on the realtime lane."""

    transcript: Transcript


@dataclass(frozen=True)
class Queued:
    """Queued as a batch job; ``created`` is false for an idempotent replay."""

    job: Job
    created: bool


async def take_upload(request: web.Request, *, fields: frozenset[str], strict: bool,
                      raw_allowed: bool,
                      parse: Callable[[Upload], T],
                      check: Callable[[T], Awaitable[None]] | None = None,
                      ) -> tuple[Upload, T, DecodedAudio]:
    """Receive the body into the blob store, ``parse`` its options (and ``check`` what
    needs I/O, such as a webhook's address), decode it.

    Options are parsed before the (costly) decode; on any UploadError nothing
    of the upload is left in the store.
    """
    app = request.app
    jobs = app[JOBS]
    upload = await receive(request, jobs.blobs, app[SETTINGS], pool=app[UPLOAD_POOL],
                           fields=fields, strict=strict, raw_allowed=raw_allowed)
    try:
        options = parse(upload)
        if check is not None:
            await check(options)
    except UploadError:
        jobs.delete_audio(upload.upload_id)
        raise
    decoded = await decode(upload, jobs.blobs, app[SETTINGS], app[UPLOAD_POOL])
    log.info("upload_decoded", job_id=upload.upload_id, bytes=upload.nbytes,
             audio_s=round(decoded.seconds, 3), container=decoded.container,
             codec=decoded.codec)
    return upload, options, decoded


async def serve_upload(app: web.Application, upload: Upload, decoded: DecodedAudio,
                       ask: UploadAsk, on_segment: OnSegment | None = None
                       ) -> Transcribed | Queued:
    """The transcript from the realtime lane, or the batch job the upload became.
    ``on_segment`` hears of each realtime-lane segment as it is decoded."""
    try:
        free = await free_realtime_slots(app)
    except BaseException:
        app[JOBS].delete_audio(upload.upload_id)
        raise
    route = route_upload(decoded.seconds, async_requested=ask.async_requested,
                         webhook=ask.webhook_url is not None, free_realtime_slots=free,
                         settings=app[SETTINGS])
    if route.reason is Reason.REALTIME_BUSY:
        log.info("realtime_unavailable", job_id=upload.upload_id, lane=Lane.REALTIME,
                 reason=f"{free} free realtime slots; {app[SETTINGS].upload_reserve_slots} "
                 "are kept for live streams")
    if route.sync:
        transcript = await _transcribe_now(app, upload.upload_id, decoded, ask, on_segment)
        if transcript is not None:
            return Transcribed(transcript)
        route = busy_fallback()
    job, created = await _submit_job(app, upload, decoded, route, ask)
    return Queued(job, created)


async def free_realtime_slots(app: web.Application) -> int:
    """Free slots on the realtime workers that take sessions (registry, up to one
    heartbeat old)."""
    workers = await list_workers(app[REDIS], Lane.REALTIME)
    return sum(w.slots_free for w in workers if not w.draining)


async def _transcribe_now(app: web.Application, upload_id: str, decoded: DecodedAudio,
                          ask: UploadAsk, on_segment: OnSegment | None) -> Transcript | None:
    """The transcript from the realtime lane, or None when the lane refused the session
    (the caller then queues a job). The blob is deleted unless None is returned."""
    jobs = app[JOBS]
    timeout = wait_timeout_s(decoded.seconds, app[SETTINGS])
    try:
        transcript = await transcribe_realtime(
            app, decoded.path, session_id=upload_id, subject=ask.subject or ask.tenant,
            language=ask.language, duration=decoded.seconds, timeout_s=timeout,
            on_segment=on_segment, prompt=ask.prompt, temperature=ask.temperature,
            task=ask.task)
    except RealtimeUnavailable as exc:
        log.info("realtime_unavailable", job_id=upload_id, lane=Lane.REALTIME, reason=str(exc))
        return None
    except RealtimeFailed as exc:
        jobs.delete_audio(upload_id)
        raise UploadError(502, exc.code, f"the realtime worker failed: {exc.message}") from None
    except TimeoutError:
        jobs.delete_audio(upload_id)
        raise UploadError(504, "timeout", f"no transcript within {timeout:.0f} s") from None
    except BaseException:
        jobs.delete_audio(upload_id)
        raise
    jobs.delete_audio(upload_id)
    log.info("upload_transcribed", job_id=upload_id, lane=Lane.REALTIME,
             audio_s=round(decoded.seconds, 3))
    return transcript


async def _submit_job(app: web.Application, upload: Upload, decoded: DecodedAudio,
                      route: Route, ask: UploadAsk) -> tuple[Job, bool]:
    """Queue the decoded upload as a batch job (the upload id becomes the job id)."""
    jobs = app[JOBS]
    try:
        job, created = await uncancelled(jobs.submit(
            job_id=upload.upload_id, tenant=ask.tenant, audio_seconds=decoded.seconds,
            language=ask.language, prompt=ask.prompt, temperature=ask.temperature,
            task=ask.task,
            response_format=ask.response_format,
            webhook_url=ask.webhook_url, filename=upload.filename,
            idempotency_key=ask.idempotency_key))
    except QuotaExceeded as exc:
        jobs.delete_audio(upload.upload_id)
        log.info("job_refused", tenant=ask.tenant, quota=exc.quota.value)
        raise UploadError(429, "quota_exceeded", str(exc),
                          headers={"Retry-After": str(exc.retry_after_s)}) from None
    except Exception:
        jobs.delete_audio(upload.upload_id)
        raise
    if created:
        JOBS_TOTAL.labels(lane=Lane.BATCH, worker="", status="queued").inc()
        log.info("job_queued", job_id=job.id, lane=Lane.BATCH, reason=route.reason.value,
                 audio_s=round(decoded.seconds, 3))
    else:
        jobs.delete_audio(upload.upload_id)
        log.info("job_replayed", job_id=job.id, lane=Lane.BATCH)
    return job, created


async def uncancelled(work: Awaitable[T]) -> T:
    """``work``'s result, run to its end even when the request is cancelled (its client
    left): a submit that reached Redis keeps its audio, and the cancellation is
    raised after it."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await asyncio.wait({task})
        raise


async def wait_for_job(app: web.Application, job: Job, tenant: str,
                       timeout_s: float) -> Transcript:
    """The job's transcript once it completes; an UploadError (with ``X-Lanegate-Job-Id``)
    when it fails, is cancelled, vanishes or is not done within ``timeout_s``."""
    jobs = app[JOBS]
    log.info("openai_waiting", job_id=job.id, lane=Lane.BATCH, timeout_s=round(timeout_s, 1))
    headers = {"X-Lanegate-Job-Id": job.id}
    try:
        job = await jobs.wait(job.id, tenant, timeout_s=timeout_s)
    except JobNotFound:
        raise UploadError(500, "job_gone", f"transcription job {job.id} vanished",
                          headers=headers) from None
    if job.status == "completed":
        transcript = await jobs.result(job.id, tenant)
        if transcript is not None:
            return transcript
        raise UploadError(500, "result_gone", f"job {job.id} completed but its result is gone",
                          headers=headers)
    if job.status == "failed":
        raise UploadError(500, "job_failed", f"transcription job {job.id} failed: {job.error}",
                          headers=headers)
    if job.status == "cancelled":
        raise UploadError(409, "job_cancelled", f"transcription job {job.id} was cancelled",
                          headers=headers)
    raise UploadError(
        504, "timeout",
        f"the transcript was not ready within {timeout_s:.0f} s; job {job.id} goes on "
        f"(status {job.status}, progress {job.progress:.0%}): fetch it with "
        f"GET /v1/transcriptions/{job.id}?format=json", headers=headers)


async def follow_job(app: web.Application, job: Job, tenant: str, timeout_s: float,
                     on_text: Callable[[str], Awaitable[None]]) -> Transcript:
    """``wait_for_job``, telling ``on_text`` the job's decoded text each time it grows
    (the batch worker stores it with the job's progress)."""
    deadline = time.monotonic() + timeout_s
    seen = ""
    while True:
        current = await app[JOBS].get(job.id, tenant)
        if current is None:
            break  # wait_for_job says it vanished
        if current.partial_text != seen:
            seen = current.partial_text
            await on_text(seen)
        left = deadline - time.monotonic()
        if current.terminal or left <= 0:
            break
        await asyncio.sleep(min(FOLLOW_POLL_S, left))
    return await wait_for_job(app, job, tenant, 0.0)
