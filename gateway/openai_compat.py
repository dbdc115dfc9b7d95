"""OpenAI-compatible ``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations``.

The request is OpenAI's multipart shape, so the official ``openai`` SDK and the
tools built on it work with ``base_url`` pointed at lanegate. Honoured fields:
``file``, ``language`` (optional: without it the engine detects the language and
``verbose_json`` reports it), ``prompt`` and ``temperature`` (0-1; both condition
Whisper's decoder, the English-only engines ignore them), ``response_format``
(``json``, ``text``, ``srt``, ``verbose_json``, ``vtt``) and
``timestamp_granularities[]`` (``segment``, ``word``; with ``verbose_json``).
``model`` is required, as by OpenAI, but any name is accepted: lanegate always
uses its configured engine.
``stream=true`` (with ``json`` or ``text``) answers with server-sent events as
OpenAI sends them (``gateway/sse.py``): a delta per decoded segment, on either lane
(a batch job's deltas follow its progress), then the whole text. Other fields newer
SDKs may send are ignored.

Routing is ``lanes.routing.route_upload``'s, as for ``/v1/transcriptions``, with
no async: audio routed to the batch lane becomes a job and the request waits for
it (up to ``wait_base_s + wait_per_audio_s x duration``; then 504 naming the
job, which goes on and can be fetched from ``/v1/transcriptions/{id}``). Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}``.

``/v1/audio/translations`` is the same request with Whisper's ``translate`` task: English
text whatever language is spoken (detected; OpenAI's translations take no ``language``),
in the same ``response_format``s, served on the same lanes. Its fields are ``file``,
``model``, ``prompt``, ``response_format`` and ``temperature``, as OpenAI's; no
``stream`` or timestamp granularities. An English-only engine (pocketsphinx) cannot
translate: it transcribes as it always does.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engines.base import Task
from gateway.auth import lease_subject, tenant_of
from gateway.dispatch import (
    Transcribed,
    UploadAsk,
    follow_job,
    serve_upload,
    take_upload,
    wait_for_job,
)
from gateway.intake import Upload, UploadError
from gateway.params import parse_bool, parse_format, parse_language
from gateway.sse import TextStream, joined
from gateway.state import SETTINGS
from gateway.uploads import CONTENT_TYPES, count_rejection
from lanegate.audio import DecodedAudio
from lanegate.logs import get_logger
from lanegate.transcript import Segment, Transcript
from lanes.routing import Lane, wait_timeout_s

log = get_logger("gateway.openai")

PATH = "/v1/audio/transcriptions"
TRANSLATIONS_PATH = "/v1/audio/translations"
RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
#: the formats ``stream=true`` takes (OpenAI streams text events only)
STREAM_FORMATS = ("json", "text")
GRANULARITIES = frozenset({"segment", "word"})
#: the fields this endpoint reads; anything else an SDK sends is ignored
FIELDS = frozenset({
    "model", "language", "prompt", "response_format", "temperature",
    "timestamp_granularities[]", "timestamp_granularities", "stream",
})
#: the fields ``/v1/audio/translations`` reads (OpenAI's: no language, stream or granularities)
TRANSLATION_FIELDS = frozenset({"model", "prompt", "response_format", "temperature"})

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
    stream: bool = False
    prompt: str = ""
    temperature: float | None = None
    task: Task = Task.TRANSCRIBE


def _ask(request: web.Request, tenant: str, options: OpenAIOptions) -> UploadAsk:
    return UploadAsk(tenant=tenant, language=options.language, prompt=options.prompt,
                     temperature=options.temperature, task=options.task,
                     subject=lease_subject(request, tenant))


def setup_openai(app: web.Application) -> None:
    """Register ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``."""
    app.router.add_post(PATH, create_transcription)
    app.router.add_post(TRANSLATIONS_PATH, create_translation)


# --- errors -------------------------------------------------------------------------------


def error_body(exc: UploadError) -> dict[str, Any]:
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return {"error": {"message": exc.message, "type": kind, "param": exc.param,
                      "code": exc.code}}


def openai_error(exc: UploadError) -> web.HTTPException:
    """OpenAI's error body. The SDK retries 409/5xx unless told otherwise: a request that
    would only repeat the same failure (or start a second job) says ``x-should-retry: false``."""
    body = error_body(exc)
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
    temperature = _temperature(upload.get("temperature"))
    stream = parse_bool(upload.get("stream"), param="stream")
    response_format = parse_format(upload.get("response_format"), RESPONSE_FORMATS)
    if stream and response_format not in STREAM_FORMATS:
        raise UploadError(400, "unsupported_value",
                          f"stream=true streams text: response_format must be json or text, "
                          f"not {response_format}", param="stream")
    granularities = _granularities(upload)
    if granularities and response_format != "verbose_json":
        raise UploadError(400, "invalid_value",
                          "timestamp_granularities requires response_format=verbose_json",
                          param="timestamp_granularities")
    return OpenAIOptions(model=model, language=parse_language(upload.get("language")),
                         response_format=response_format, granularities=granularities,
                         stream=stream, prompt=(upload.get("prompt") or "").strip(),
                         temperature=temperature)


def parse_translation_options(upload: Upload) -> OpenAIOptions:
    """A translation's options: a transcription's minus the language (detected), the
    stream and the granularities, with the ``translate`` task."""
    model = (upload.get("model") or "").strip()
    if not model:
        raise UploadError(400, "missing_required_parameter",
                          "you must provide a model parameter", param="model")
    return OpenAIOptions(model=model, language="",
                         response_format=parse_format(upload.get("response_format"),
                                                      RESPONSE_FORMATS),
                         granularities=frozenset(),
                         prompt=(upload.get("prompt") or "").strip(),
                         temperature=_temperature(upload.get("temperature")),
                         task=Task.TRANSLATE)


def _temperature(raw: str | None) -> float | None:
    """The temperature asked for, or None (the engine's default)."""
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise UploadError(400, "invalid_value", "temperature must be a number from 0 to 1",
                          param="temperature")
    return value


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
    return web.json_response({**verbose_json(transcript, options.granularities, options.task),
                              "usage": usage}, headers=headers)


def verbose_json(transcript: Transcript, granularities: frozenset[str],
                 task: Task = Task.TRANSCRIBE) -> dict[str, Any]:
    """OpenAI's ``verbose_json``. Whisper-only numbers (tokens, log-probabilities,
    compression ratio) have neutral placeholder values. A translation's ``language``
    is the output's, always ``english`` (as OpenAI's)."""
    language = "en" if task is Task.TRANSLATE else transcript.language.split("-")[0]
    body: dict[str, Any] = {
        "task": task.value,
        "language": LANGUAGE_NAMES.get(language, transcript.language),
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


def _job_wait_s(request: web.Request, decoded: DecodedAudio) -> float:
    """How long the request waits for a batch job."""
    timeout = wait_timeout_s(decoded.seconds, request.app[SETTINGS])
    client_cap = client_wait_cap_s(request)
    return timeout if client_cap is None else min(timeout, client_cap)


async def create_transcription(request: web.Request) -> web.StreamResponse:
    """``POST /v1/audio/transcriptions``."""
    return await _answer(request, FIELDS, parse_openai_options)


async def create_translation(request: web.Request) -> web.StreamResponse:
    """``POST /v1/audio/translations``: the same, with Whisper's ``translate`` task."""
    return await _answer(request, TRANSLATION_FIELDS, parse_translation_options)


async def _answer(request: web.Request, fields: frozenset[str],
                  parse: Callable[[Upload], OpenAIOptions]) -> web.StreamResponse:
    tenant = _tenant(request)
    try:
        upload, options, decoded = await take_upload(
            request, fields=fields, strict=False, raw_allowed=False, parse=parse)
        if options.stream:
            return await stream_transcription(request, upload, options, decoded, tenant)
        served = await serve_upload(request.app, upload, decoded,
                                    _ask(request, tenant, options))
        if isinstance(served, Transcribed):
            return render(served.transcript, options, {"X-Lanegate-Lane": Lane.REALTIME})
        # no "async" here: long audio waits for its job, off the realtime lane
        job = served.job
        try:
            transcript = await wait_for_job(request.app, job, tenant,
                                            _job_wait_s(request, decoded))
        except asyncio.CancelledError:  # the client hung up (handler_cancellation)
            log.info("openai_client_gone", job_id=job.id, lane=Lane.BATCH,
                     message="stopped waiting; the job goes on")
            raise
    except UploadError as exc:
        count_rejection(exc)
        raise openai_error(exc) from None
    return render(transcript, options, {"X-Lanegate-Lane": Lane.BATCH, "X-Lanegate-Job-Id": job.id})


async def stream_transcription(request: web.Request, upload: Upload, options: OpenAIOptions,
                               decoded: DecodedAudio, tenant: str) -> web.StreamResponse:
    """``stream=true``: a delta per segment as the realtime lane decodes it, or as the
    batch job's progress reports it, then ``transcript.text.done``."""
    stream = TextStream(request, {})
    texts: list[str] = []

    async def on_segment(segment: Segment) -> None:
        stream.headers.setdefault("X-Lanegate-Lane", Lane.REALTIME)
        texts.append(segment.text)
        await stream.grow(joined(texts))

    try:
        served = await serve_upload(request.app, upload, decoded,
                                    _ask(request, tenant, options),
                                    on_segment=on_segment)
        if isinstance(served, Transcribed):
            stream.headers.setdefault("X-Lanegate-Lane", Lane.REALTIME)
            return await stream.done(served.transcript.text)
        job = served.job
        stream.headers.update({"X-Lanegate-Lane": Lane.BATCH, "X-Lanegate-Job-Id": job.id})
        transcript = await follow_job(request.app, job, tenant, _job_wait_s(request, decoded),
                                      stream.grow)
    except UploadError as exc:
        if not stream.started:
            raise
        count_rejection(exc)
        return await stream.error(error_body(exc))
    return await stream.done(transcript.text)
