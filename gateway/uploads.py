"""The upload API: ``/v1/transcriptions``.

* ``POST /v1/transcriptions``: multipart ``file`` (+ ``language``,
  ``response_format``, ``async``, ``webhook_url``) or a raw audio body (options
  in the query string). ``gateway.dispatch.serve_upload`` serves it on the lane
  ``lanes.routing.route_upload`` picks: the realtime lane (200 + the result) or a
  batch job (202 + ``Location`` + the job JSON). ``Idempotency-Key`` makes job
  creation idempotent per API key.
* ``GET /v1/transcriptions/{id}``: the job JSON; with ``?format=`` its result.
* ``GET /v1/transcriptions``: the caller's jobs, newest first, ``?limit=&cursor=``.
* ``DELETE /v1/transcriptions/{id}``: cancel a queued or running job.

Another tenant's job is a 404, exactly like a job that does not exist.
"""

from __future__ import annotations

import re
from concurrent.futures import Executor
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from gateway.auth import lease_subject, tenant_of
from gateway.dispatch import Transcribed, UploadAsk, serve_upload, take_upload
from gateway.errors import json_error
from gateway.intake import Upload, UploadError
from gateway.params import parse_bool, parse_format, parse_language
from gateway.state import JOBS, SETTINGS, UPLOAD_POOL
from lanegate.logs import get_logger
from lanegate.metrics import JOBS as JOBS_TOTAL
from lanegate.metrics import REJECTIONS
from lanegate.settings import Settings
from lanegate.transcript import FORMATS, Transcript
from lanegate.webhooks import WebhookRefused, check_webhook_url, pool_lookup, webhooks_enabled
from lanes.job_protocol import Job
from lanes.jobs import JobStore
from lanes.routing import Lane

log = get_logger("gateway.uploads")

#: option fields of POST /v1/transcriptions (form fields or query parameters)
FIELDS = frozenset({"language", "response_format", "async", "webhook_url"})
#: GET /v1/transcriptions?limit=: default and maximum page size
LIST_DEFAULT = 20
LIST_MAX = 100
IDEMPOTENCY_KEY_MAX = 255
WEBHOOK_URL_MAX = 2048

CONTENT_TYPES = {
    "json": "application/json",
    "verbose_json": "application/json",
    "text": "text/plain",
    "srt": "application/x-subrip",
    "vtt": "text/vtt",
}

_JOB_ID = re.compile(r"^[0-9a-f]{32}$")


def setup_uploads(app: web.Application) -> None:
    """Register the ``/v1/transcriptions`` routes on ``app``."""
    app.router.add_post("/v1/transcriptions", create_transcription)
    app.router.add_get("/v1/transcriptions", list_transcriptions)
    app.router.add_get("/v1/transcriptions/{job_id}", get_transcription)
    app.router.add_delete("/v1/transcriptions/{job_id}", delete_transcription)


# --- validation ---------------------------------------------------------------------


@dataclass(frozen=True)
class UploadOptions:
    language: str
    response_format: str
    async_: bool
    webhook_url: str | None


def parse_webhook_url(raw: str | None) -> str | None:
    if not raw:
        return None
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname or len(raw) > WEBHOOK_URL_MAX:
        raise UploadError(400, "invalid_webhook_url",
                          "webhook_url must be an absolute http(s) URL of at most "
                          f"{WEBHOOK_URL_MAX} characters", param="webhook_url")
    return raw


async def check_webhook(url: str, settings: Settings, pool: Executor) -> None:
    """Webhooks are on (a secret is set) and ``url`` resolves only to allowed addresses
    (looked up on the upload pool, not the loop's default executor)."""
    if not webhooks_enabled(settings):
        raise UploadError(400, "webhooks_disabled", "webhooks are off on this server (no "
                          "webhook secret is configured)", param="webhook_url")
    try:
        await check_webhook_url(url, settings, lookup=pool_lookup(pool))
    except WebhookRefused as exc:
        raise UploadError(400, "invalid_webhook_url", str(exc), param="webhook_url") from None


def parse_options(upload: Upload) -> UploadOptions:
    return UploadOptions(
        language=parse_language(upload.get("language")),
        response_format=parse_format(upload.get("response_format"), FORMATS),
        async_=parse_bool(upload.get("async"), param="async"),
        webhook_url=parse_webhook_url(upload.get("webhook_url")),
    )


def idempotency_key(request: web.Request) -> str | None:
    raw = request.headers.get("Idempotency-Key")
    if raw is None:
        return None
    key = raw.strip()
    if not key or len(key) > IDEMPOTENCY_KEY_MAX or not key.isascii() or not key.isprintable():
        raise json_error(400, "invalid_idempotency_key",
                         f"Idempotency-Key must be 1-{IDEMPOTENCY_KEY_MAX} printable ASCII "
                         "characters")
    return key


# --- responses ------------------------------------------------------------------------


def result_response(transcript: Transcript, fmt: str, *, status: int = 200,
                    headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=transcript.render(fmt),
                        content_type=CONTENT_TYPES[fmt], charset="utf-8", headers=headers)


def job_response(job: Job, *, status: int = 200,
                 headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(job.to_public(), status=status, headers=headers)


def count_rejection(exc: UploadError) -> None:
    """Count a refused request (4xx, or 504) in ``lanegate_rejections_total`` by reason."""
    if exc.status < 500 or exc.status == 504:
        REJECTIONS.labels(lane=Lane.BATCH, reason=rejection_reason(exc.status, exc.code)).inc()


def rejection_reason(status: int, code: str) -> str:
    if status == 413:
        return "too_large"
    if status == 504:
        return "timeout"
    if code == "audio_too_long":
        return "too_long"
    if status in (415, 422):
        return "undecodable"
    return "bad_request"


def native_error(exc: UploadError) -> web.HTTPException:
    """``{"error": {"code", "message"}}`` with the error's status and headers."""
    return json_error(exc.status, exc.code, exc.message, headers=exc.headers or None)


# --- POST /v1/transcriptions ------------------------------------------------------------


async def create_transcription(request: web.Request) -> web.StreamResponse:
    tenant = tenant_of(request)
    idem = idempotency_key(request)
    try:
        settings = request.app[SETTINGS]

        async def check(options: UploadOptions) -> None:
            if options.webhook_url is not None:
                await check_webhook(options.webhook_url, settings, request.app[UPLOAD_POOL])

        upload, options, decoded = await take_upload(
            request, fields=FIELDS, strict=True, raw_allowed=True, parse=parse_options,
            check=check)
        served = await serve_upload(request.app, upload, decoded, UploadAsk(
            tenant=tenant, language=options.language,
            response_format=options.response_format, async_requested=options.async_,
            webhook_url=options.webhook_url, idempotency_key=idem,
            subject=lease_subject(request, tenant)))
    except UploadError as exc:
        count_rejection(exc)
        raise native_error(exc) from None
    if isinstance(served, Transcribed):
        return result_response(served.transcript, options.response_format,
                               headers={"X-Lanegate-Lane": Lane.REALTIME})
    job = served.job
    headers = {"Location": f"/v1/transcriptions/{job.id}", "X-Lanegate-Lane": Lane.BATCH}
    if not served.created:
        headers["Idempotent-Replayed"] = "true"
    return job_response(job, status=202, headers=headers)


# --- GET / DELETE ------------------------------------------------------------------


def _job_id(request: web.Request) -> str:
    job_id = request.match_info["job_id"]
    if not _JOB_ID.match(job_id):
        raise _not_found(job_id)
    return job_id


def _not_found(job_id: str) -> web.HTTPException:
    return json_error(404, "not_found", f"no transcription job {job_id!r}")


async def _callers_job(request: web.Request) -> tuple[JobStore, str, Job]:
    """The store, the tenant and the job the path names; 404 for anyone else's job."""
    tenant = tenant_of(request)
    job_id = _job_id(request)
    jobs = request.app[JOBS]
    job = await jobs.get(job_id, tenant)
    if job is None:
        raise _not_found(job_id)
    return jobs, tenant, job


async def get_transcription(request: web.Request) -> web.StreamResponse:
    jobs, tenant, job = await _callers_job(request)
    job_id = job.id
    fmt = request.query.get("format")
    if fmt is None:
        return job_response(job)
    try:
        fmt = parse_format(fmt, FORMATS, param="format")
    except UploadError as exc:
        raise json_error(400, exc.code, exc.message) from None
    if job.status != "completed":
        raise json_error(409, "not_completed",
                         f"job {job_id} is {job.status}; its result exists once it is completed")
    transcript = await jobs.result(job_id, tenant)
    if transcript is None:
        raise json_error(404, "result_gone", f"the result of job {job_id} is no longer stored")
    return result_response(transcript, fmt)


async def list_transcriptions(request: web.Request) -> web.StreamResponse:
    tenant = tenant_of(request)
    limit = _limit(request.query.get("limit"))
    cursor = request.query.get("cursor") or None
    try:
        jobs, next_cursor = await request.app[JOBS].list_jobs(tenant, limit=limit,
                                                                  cursor=cursor)
    except ValueError:
        raise json_error(400, "invalid_cursor", "cursor is not one this API returned") from None
    return web.json_response({
        "object": "list",
        "data": [job.to_public() for job in jobs],
        "next_cursor": next_cursor,
        "has_more": next_cursor is not None,
    })


def _limit(raw: str | None) -> int:
    if raw is None:
        return LIST_DEFAULT
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= LIST_MAX:
        raise json_error(400, "invalid_limit", f"limit must be an integer from 1 to {LIST_MAX}")
    return value


async def delete_transcription(request: web.Request) -> web.StreamResponse:
    jobs, tenant, before = await _callers_job(request)
    job_id = before.id
    job = await jobs.cancel(job_id, tenant)
    if job is None:
        raise _not_found(job_id)
    if job.status != "cancelled":
        raise json_error(409, "not_cancellable",
                         f"job {job_id} is already {job.status} and cannot be cancelled")
    if before.status != "cancelled":
        JOBS_TOTAL.labels(lane=Lane.BATCH, worker="", status="cancelled").inc()
        log.info("job_cancelled", job_id=job_id, lane=Lane.BATCH, was=before.status)
    return job_response(job)

