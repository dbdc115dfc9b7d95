"""The upload API: ``/v1/transcriptions``.

* ``POST /v1/transcriptions``: multipart ``file`` (+ ``language``,
  ``response_format``, ``async``, ``webhook_url``) or a raw audio body (options
  in the query string). Short audio that is not marked async is transcribed now
  on the realtime lane (200 + the result); anything else becomes a batch job
  (202 + ``Location`` + the job JSON). ``Idempotency-Key`` makes job creation
  idempotent per API key.
* ``GET /v1/transcriptions/{id}``: the job JSON; with ``?format=`` its result.
* ``GET /v1/transcriptions``: the caller's jobs, newest first, ``?limit=&cursor=``.
* ``DELETE /v1/transcriptions/{id}``: cancel a queued or running job.

Another tenant's job is a 404, exactly like a job that does not exist.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from gateway.auth import tenant_of
from gateway.errors import json_error
from gateway.intake import Upload, UploadError, decode, receive
from gateway.realtime_upload import RealtimeFailed, RealtimeUnavailable, transcribe_realtime
from gateway.state import REDIS, SETTINGS
from lanegate.audio import DecodedAudio
from lanegate.blobs import BlobStore
from lanegate.logs import get_logger
from lanegate.metrics import JOBS, REJECTIONS
from lanegate.transcript import FORMATS, Transcript
from lanes.jobs import Job, JobStore
from lanes.routing import Route, busy_fallback, route_upload, wait_timeout_s

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

_LANGUAGE = re.compile(r"^[a-z]{2,3}(-[a-z0-9]{2,8})?$")
_JOB_ID = re.compile(r"^[0-9a-f]{32}$")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


# --- shared state -----------------------------------------------------------------


class UploadState:
    """The job store and blob store, built on first use from the app's Redis and settings."""

    def __init__(self) -> None:
        self._jobs: JobStore | None = None

    def jobs(self, app: web.Application) -> JobStore:
        if self._jobs is None:
            self._jobs = JobStore(app[REDIS], app[SETTINGS])
        return self._jobs

    def blobs(self, app: web.Application) -> BlobStore:
        return self.jobs(app).blobs


UPLOADS = web.AppKey("uploads", UploadState)


def jobs_of(app: web.Application) -> JobStore:
    return app[UPLOADS].jobs(app)


def blobs_of(app: web.Application) -> BlobStore:
    return app[UPLOADS].blobs(app)


def setup_uploads(app: web.Application) -> None:
    """Register the ``/v1/transcriptions`` routes on ``app``."""
    if UPLOADS not in app:
        app[UPLOADS] = UploadState()
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


def parse_language(raw: str | None, *, param: str = "language") -> str:
    value = (raw or "en").strip().lower()
    if not _LANGUAGE.match(value):
        raise UploadError(400, "invalid_language",
                          f"language {raw!r} is not a language code such as `en` or `en-us`",
                          param=param)
    return value


def parse_format(raw: str | None, allowed: tuple[str, ...], *,
                 param: str = "response_format") -> str:
    value = (raw or "json").strip().lower()
    if value not in allowed:
        raise UploadError(400, "invalid_response_format",
                          f"response_format {raw!r} is not one of {', '.join(allowed)}",
                          param=param)
    return value


def parse_bool(raw: str | None, *, param: str) -> bool:
    value = (raw or "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise UploadError(400, "invalid_boolean", f"{param} must be true or false, not {raw!r}",
                      param=param)


def parse_webhook_url(raw: str | None) -> str | None:
    if not raw:
        return None
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname or len(raw) > WEBHOOK_URL_MAX:
        raise UploadError(400, "invalid_webhook_url",
                          "webhook_url must be an absolute http(s) URL of at most "
                          f"{WEBHOOK_URL_MAX} characters", param="webhook_url")
    return raw


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


def count_rejection(exc: UploadError, lane: str = "batch") -> None:
    """Count a refused request (4xx, or 504) in ``lanegate_rejections_total`` by reason."""
    if exc.status < 500 or exc.status == 504:
        REJECTIONS.labels(lane=lane, reason=rejection_reason(exc.status, exc.code)).inc()


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


async def take_upload(request: web.Request, *, fields: frozenset[str], strict: bool,
                      raw_allowed: bool) -> Upload:
    """Receive the request body into the blob store (UploadError on bad input)."""
    return await receive(request, blobs_of(request.app), request.app[SETTINGS],
                         fields=fields, strict=strict, raw_allowed=raw_allowed)


async def decode_taken(request: web.Request, upload: Upload) -> DecodedAudio:
    decoded = await decode(upload, blobs_of(request.app), request.app[SETTINGS])
    log.info("upload_decoded", job_id=upload.upload_id, bytes=upload.nbytes,
             audio_s=round(decoded.seconds, 3), container=decoded.container,
             codec=decoded.codec)
    return decoded


async def create_transcription(request: web.Request) -> web.StreamResponse:
    tenant = tenant_of(request)
    idem = idempotency_key(request)
    try:
        upload = await take_upload(request, fields=FIELDS, strict=True, raw_allowed=True)
        options = _options_or_cleanup(request, upload)
        decoded = await decode_taken(request, upload)
        # a webhook only exists for jobs: asking for one asks for a job
        wants_job = options.async_ or options.webhook_url is not None
        route = route_upload(decoded.seconds, async_requested=wants_job,
                             settings=request.app[SETTINGS])
        return await _answer(request, tenant, upload, decoded, options, route, idem)
    except UploadError as exc:
        count_rejection(exc)
        raise native_error(exc) from None


def _options_or_cleanup(request: web.Request, upload: Upload) -> UploadOptions:
    try:
        return parse_options(upload)
    except UploadError:
        blobs_of(request.app).delete(upload.upload_id)
        raise


async def _answer(request: web.Request, tenant: str, upload: Upload, decoded: DecodedAudio,
                  options: UploadOptions, route: Route, idem: str | None) -> web.StreamResponse:
    if route.sync:
        transcript = await transcribe_now(request, tenant, upload.upload_id, decoded,
                                          options.language)
        if transcript is not None:
            return result_response(transcript, options.response_format,
                                   headers={"X-Lanegate-Lane": "realtime"})
        route = busy_fallback()
    job, created = await submit_job(request, tenant, upload, decoded, route,
                                    language=options.language,
                                    response_format=options.response_format,
                                    webhook_url=options.webhook_url, idem=idem)
    headers = {"Location": f"/v1/transcriptions/{job.id}", "X-Lanegate-Lane": "batch"}
    if not created:
        headers["Idempotent-Replayed"] = "true"
    return job_response(job, status=202, headers=headers)


async def transcribe_now(request: web.Request, tenant: str, upload_id: str,
                         decoded: DecodedAudio, language: str) -> Transcript | None:
    """The transcript from the realtime lane, or None when the lane cannot take it
    (the caller then queues a job). The blob is deleted unless None is returned."""
    app = request.app
    blobs = blobs_of(app)
    timeout = wait_timeout_s(decoded.seconds, app[SETTINGS])
    try:
        transcript = await transcribe_realtime(
            app, decoded.path, session_id=upload_id, tenant=tenant, language=language,
            duration=decoded.seconds, timeout_s=timeout)
    except RealtimeUnavailable as exc:
        log.info("realtime_unavailable", job_id=upload_id, lane="realtime", reason=str(exc))
        return None
    except RealtimeFailed as exc:
        blobs.delete(upload_id)
        raise UploadError(502, exc.code, f"the realtime worker failed: {exc.message}") from None
    except TimeoutError:
        blobs.delete(upload_id)
        raise UploadError(504, "timeout", f"no transcript within {timeout:.0f} s") from None
    except BaseException:
        blobs.delete(upload_id)
        raise
    blobs.delete(upload_id)
    log.info("upload_transcribed", job_id=upload_id, lane="realtime",
             audio_s=round(decoded.seconds, 3))
    return transcript


async def submit_job(request: web.Request, tenant: str, upload: Upload, decoded: DecodedAudio,
                     route: Route, *, language: str, response_format: str,
                     webhook_url: str | None, idem: str | None) -> tuple[Job, bool]:
    """Queue the decoded upload as a batch job (the upload id becomes the job id)."""
    jobs = jobs_of(request.app)
    try:
        job, created = await jobs.submit(
            job_id=upload.upload_id, tenant=tenant, audio_seconds=decoded.seconds,
            language=language, response_format=response_format, webhook_url=webhook_url,
            filename=upload.filename, idempotency_key=idem)
    except BaseException:
        jobs.delete_audio(upload.upload_id)
        raise
    if created:
        JOBS.labels(lane="batch", worker="", status="queued").inc()
        log.info("job_queued", job_id=job.id, lane="batch", reason=route.reason.value,
                 audio_s=round(decoded.seconds, 3))
    else:
        jobs.delete_audio(upload.upload_id)
        log.info("job_replayed", job_id=job.id, lane="batch")
    return job, created


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
    jobs = jobs_of(request.app)
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
        jobs, next_cursor = await jobs_of(request.app).list_jobs(tenant, limit=limit,
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
        JOBS.labels(lane="batch", worker="", status="cancelled").inc()
        log.info("job_cancelled", job_id=job_id, lane="batch", was=before.status)
    return job_response(job)

