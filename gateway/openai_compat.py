"""OpenAI-compatible ``POST /v1/audio/transcriptions``.

The request is OpenAI's multipart shape, so the official ``openai`` SDK and the
tools built on it work with ``base_url`` pointed at lanegate. Honoured fields:
``file``, ``language``, ``response_format`` (``json``, ``text``, ``srt``,
``verbose_json``, ``vtt``) and ``timestamp_granularities[]`` (``segment``,
``word``; with ``verbose_json``). ``model`` is required, as by OpenAI, but any
name is accepted: lanegate always uses its configured engine. ``prompt`` and
``temperature`` are validated and ignored (the engines here take neither).
``stream=true`` is refused; other fields newer SDKs may send are ignored.

Routing: short audio (``sync_max_seconds``) is transcribed on the realtime
lane; longer audio becomes a batch job and the request waits for it (up to
``wait_base_s + wait_per_audio_s x duration``; then 504 naming the job, which
goes on and can be fetched from ``/v1/transcriptions/{id}``). A long prefill
never lands on the realtime lane. Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.auth import tenant_of
from gateway.intake import Upload, UploadError
from gateway.state import SETTINGS
from gateway.uploads import (
    CONTENT_TYPES,
    count_rejection,
    decode_taken,
    jobs_of,
    parse_bool,
    parse_format,
    parse_language,
    submit_job,
    take_upload,
    transcribe_now,
)
from lanegate.audio import DecodedAudio
from lanegate.logs import get_logger
from lanegate.transcript import Transcript
from lanes.jobs import JobNotFound
from lanes.routing import Route, busy_fallback, route_upload, wait_timeout_s

log = get_logger("gateway.openai")

PATH = "/v1/audio/transcriptions"
RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = frozenset({"segment", "word"})
#: the fields this endpoint reads; anything else an SDK sends is ignored
FIELDS = frozenset({
    "model", "language", "prompt", "response_format", "temperature",
    "timestamp_granularities[]", "timestamp_granularities", "stream",
})

#: the SDK announces its read timeout; the wait for a batch job ends before it
CLIENT_TIMEOUT_HEADER = "x-stainless-read-timeout"
CLIENT_TIMEOUT_SHARE = 0.9
CLIENT_TIMEOUT_MARGIN_S = 1.0
MIN_WAIT_S = 1.0

#: ISO-639-1 code -> the language name OpenAI's verbose_json reports
LANGUAGE_NAMES = {
    "en": "english", "de": "german", "fr": "french", "es": "spanish", "it": "italian",
    "pt": "portuguese", "nl": "dutch", "ru": "russian", "zh": "chinese", "ja": "japanese",
    "ko": "korean", "ar": "arabic", "hi": "hindi", "pl": "polish", "tr": "turkish",
    "sv": "swedish", "uk": "ukrainian", "cs": "czech", "el": "greek", "fi": "finnish",
}


@dataclass(frozen=True)
class OpenAIOptions:
    model: str
    language: str
    response_format: str
    granularities: frozenset[str]


def setup_openai(app: web.Application) -> None:
    """Register ``POST /v1/audio/transcriptions`` on ``app``."""
    app.router.add_post(PATH, create_transcription)


# --- errors -------------------------------------------------------------------------------


def openai_error(exc: UploadError) -> web.HTTPException:
    """OpenAI's error body. The SDK retries 409/5xx unless told otherwise: a request that
    would only repeat the same failure (or start a second job) says ``x-should-retry: false``."""
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    body = {"error": {"message": exc.message, "type": kind, "param": exc.param,
                      "code": exc.code}}
    headers = {"x-should-retry": "false", **exc.headers}
    http = web.HTTPException(text=json.dumps(body), content_type="application/json",
                             headers=headers)
    http.set_status(exc.status)
    return http


def _tenant(request: web.Request) -> str:
    try:
        return tenant_of(request)
    except web.HTTPException as exc:
        code = "invalid_api_key" if exc.status == 401 else "forbidden"
        raise openai_error(UploadError(
            exc.status, code, "Incorrect or missing API key; pass it as a Bearer token.",
            headers={"WWW-Authenticate": 'Bearer realm="lanegate"'},
        )) from None


# --- validation -------------------------------------------------------------------------


def parse_openai_options(upload: Upload) -> OpenAIOptions:
    model = (upload.get("model") or "").strip()
    if not model:
        raise UploadError(400, "missing_required_parameter",
                          "you must provide a model parameter", param="model")
    _check_temperature(upload.get("temperature"))
    if parse_bool(upload.get("stream"), param="stream"):
        raise UploadError(400, "unsupported_parameter",
                          "stream=true is not supported; lanegate answers with the whole "
                          "transcript (use /v1/stream for live text)", param="stream")
    response_format = parse_format(upload.get("response_format"), RESPONSE_FORMATS)
    granularities = _granularities(upload)
    if granularities and response_format != "verbose_json":
        raise UploadError(400, "invalid_value",
                          "timestamp_granularities requires response_format=verbose_json",
                          param="timestamp_granularities")
    return OpenAIOptions(model=model, language=parse_language(upload.get("language")),
                         response_format=response_format, granularities=granularities)


def _check_temperature(raw: str | None) -> None:
    if raw is None or raw == "":
        return
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise UploadError(400, "invalid_value", "temperature must be a number from 0 to 1",
                          param="temperature")


def _granularities(upload: Upload) -> frozenset[str]:
    values = upload.get_all("timestamp_granularities[]") + upload.get_all(
        "timestamp_granularities")
    names = frozenset(v.strip().lower() for v in values if v.strip())
    unknown = names - GRANULARITIES
    if unknown:
        raise UploadError(400, "invalid_value",
                          f"unknown timestamp granularity {sorted(unknown)[0]!r}; "
                          "use segment or word", param="timestamp_granularities")
    return names


# --- rendering ----------------------------------------------------------------------------


def render(transcript: Transcript, options: OpenAIOptions,
           headers: dict[str, str]) -> web.Response:
    fmt = options.response_format
    if fmt in ("text", "srt", "vtt"):
        return web.Response(text=transcript.render(fmt), content_type=CONTENT_TYPES[fmt],
                            charset="utf-8", headers=headers)
    usage = {"type": "duration", "seconds": math.ceil(transcript.duration)}
    if fmt == "json":
        return web.json_response({"text": transcript.text, "usage": usage}, headers=headers)
    return web.json_response({**verbose_json(transcript, options.granularities),
                              "usage": usage}, headers=headers)


def verbose_json(transcript: Transcript, granularities: frozenset[str]) -> dict[str, Any]:
    """OpenAI's ``verbose_json``. Whisper-only numbers (tokens, log-probabilities,
    compression ratio) have neutral placeholder values."""
    body: dict[str, Any] = {
        "task": "transcribe",
        "language": LANGUAGE_NAMES.get(transcript.language.split("-")[0], transcript.language),
        "duration": round(transcript.duration, 3),
        "text": transcript.text,
    }
    if not granularities or "segment" in granularities:
        body["segments"] = [
            {"id": index, "seek": int(seg.start * 100), "start": round(seg.start, 3),
             "end": round(seg.end, 3), "text": seg.text, "tokens": [], "temperature": 0.0,
             "avg_logprob": 0.0, "compression_ratio": 0.0, "no_speech_prob": 0.0}
            for index, seg in enumerate(s for s in transcript.segments if s.text)
        ]
    if "word" in granularities:
        body["words"] = [
            {"word": w.word, "start": round(w.start, 3), "end": round(w.end, 3)}
            for seg in transcript.segments for w in seg.words
        ]
    return body


def client_wait_cap_s(request: web.Request) -> float | None:
    """How long the client will wait for the answer, from the ``openai`` SDK's
    ``x-stainless-read-timeout`` header, less a margin; None without the header.

    Answering (504 naming the job, ``x-should-retry: false``) before the SDK's own
    read timeout keeps it from retrying, which would queue the same audio again.
    """
    raw = request.headers.get(CLIENT_TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        return None
    if not math.isfinite(seconds) or seconds <= 0:
        return None
    return max(MIN_WAIT_S, seconds * CLIENT_TIMEOUT_SHARE - CLIENT_TIMEOUT_MARGIN_S)


# --- the handler --------------------------------------------------------------------------


async def create_transcription(request: web.Request) -> web.StreamResponse:
    tenant = _tenant(request)
    try:
        upload = await take_upload(request, fields=FIELDS, strict=False, raw_allowed=False)
        options = _options_or_cleanup(request, upload)
        decoded = await decode_taken(request, upload)
        transcript, headers = await _transcribe(request, tenant, upload, decoded, options)
    except UploadError as exc:
        count_rejection(exc)
        raise openai_error(exc) from None
    return render(transcript, options, headers)


def _options_or_cleanup(request: web.Request, upload: Upload) -> OpenAIOptions:
    try:
        return parse_openai_options(upload)
    except UploadError:
        jobs_of(request.app).delete_audio(upload.upload_id)
        raise


async def _transcribe(request: web.Request, tenant: str, upload: Upload,
                      decoded: DecodedAudio,
                      options: OpenAIOptions) -> tuple[Transcript, dict[str, str]]:
    """The transcript and the response headers naming the lane (and job) that made it."""
    route = route_upload(decoded.seconds, async_requested=False,
                         settings=request.app[SETTINGS])
    if route.sync:
        transcript = await transcribe_now(request, tenant, upload.upload_id, decoded,
                                          options.language)
        if transcript is not None:
            return transcript, {"X-Lanegate-Lane": "realtime"}
        route = busy_fallback()
    return await _through_batch(request, tenant, upload, decoded, options, route)


async def _through_batch(request: web.Request, tenant: str, upload: Upload,
                         decoded: DecodedAudio, options: OpenAIOptions,
                         route: Route) -> tuple[Transcript, dict[str, str]]:
    """Queue a batch job and wait for it: long audio never goes to the realtime lane."""
    job, _ = await submit_job(request, tenant, upload, decoded, route,
                              language=options.language, response_format="json",
                              webhook_url=None, idem=None)
    jobs = jobs_of(request.app)
    timeout = wait_timeout_s(decoded.seconds, request.app[SETTINGS])
    client_cap = client_wait_cap_s(request)
    if client_cap is not None:
        timeout = min(timeout, client_cap)
    log.info("openai_waiting", job_id=job.id, lane="batch", timeout_s=round(timeout, 1))
    headers = {"X-Lanegate-Job-Id": job.id}
    try:
        job = await jobs.wait(job.id, tenant, timeout_s=timeout)
    except JobNotFound:
        raise UploadError(500, "job_gone", f"transcription job {job.id} vanished",
                          headers=headers) from None
    if job.status == "completed":
        transcript = await jobs.result(job.id, tenant)
        if transcript is not None:
            return transcript, {"X-Lanegate-Lane": "batch", **headers}
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
        f"the transcript was not ready within {timeout:.0f} s; job {job.id} goes on "
        f"(status {job.status}, progress {job.progress:.0%}): fetch it with "
        f"GET /v1/transcriptions/{job.id}?format=json", headers=headers)
