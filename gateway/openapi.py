"""``GET /openapi.json``: the OpenAPI 3.1 document of the gateway's HTTP routes.
(Over 400 lines: it is the document, one schema per route and error body.)

The document is built here from the same constants the handlers check (formats,
page sizes, sample rates, ``gateway.params.LANGUAGE_PATTERN``, ``JobStatus``), once
per process: a rule is imported, never copied. ``tests/test_openapi.py`` checks it
with ``openapi-spec-validator``, checks that it names every route the app
registers, and runs schemathesis against a live stack with it.

``/v1/stream`` is a WebSocket: the document describes its upgrade request and the
``426`` a plain GET gets; the messages are in the README's protocol section.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from aiohttp import web

from gateway import deepgram_openapi
from gateway.openai_compat import RESPONSE_FORMATS as OPENAI_FORMATS
from gateway.page import STATIC_FILES
from gateway.params import LANGUAGE_PATTERN
from gateway.uploads import LIST_DEFAULT, LIST_MAX
from lanegate.audio import MAX_STREAM_SAMPLE_RATE as MAX_SAMPLE_RATE
from lanegate.audio import MIN_STREAM_SAMPLE_RATE as MIN_SAMPLE_RATE
from lanegate.deepgram_response import DEEPGRAM_FORMAT
from lanegate.transcript import FORMATS
from lanes.job_protocol import JobStatus

PATH = "/openapi.json"
VERSION = "0.1.0"

Schema = dict[str, Any]

#: a ``language`` parameter, checked by ``gateway.params.parse_language`` with this pattern
LANGUAGE: Schema = {"type": "string", "pattern": LANGUAGE_PATTERN}
JOB_ID_PATTERN = r"^[0-9a-f]{32}$"
RESULT_TYPES = {
    "json": "application/json",
    "text": "text/plain",
    "srt": "application/x-subrip",
    "vtt": "text/vtt",
}

SECURED: list[dict[str, list[str]]] = [{"bearer": []}, {"apiKeyQuery": []}]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(kind: str) -> Schema:
    return {"type": [kind, "null"]}


def _json(schema: Schema, description: str, **extra: Any) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}},
            **extra}


def _error(description: str, schema: str = "Error", **extra: Any) -> Schema:
    return _json(_ref(schema), description, **extra)


def _header(description: str, schema: Schema | None = None) -> Schema:
    return {"description": description, "schema": schema or {"type": "string"}}


def _query(name: str, schema: Schema, description: str) -> Schema:
    return {"name": name, "in": "query", "required": False, "schema": schema,
            "description": description}


# --- component schemas ---------------------------------------------------------------


def _schemas() -> dict[str, Schema]:
    word = {"type": "object", "required": ["word", "start", "end"], "properties": {
        "word": {"type": "string"},
        "start": {"type": "number", "description": "seconds from the start of the audio"},
        "end": {"type": "number"},
    }}
    segment = {"type": "object", "required": ["start", "end", "text", "words", "cut"],
               "properties": {
                   "start": {"type": "number"}, "end": {"type": "number"},
                   "text": {"type": "string"},
                   "words": {"type": "array", "items": _ref("Word")},
                   "cut": {"type": "string", "enum": ["endpoint", "max_window", "end"],
                           "description": "why the VAD ended the segment"},
               }}
    transcript = {"type": "object", "required": ["text", "duration", "segments", "language"],
                  "properties": {
                      "text": {"type": "string"}, "duration": {"type": "number"},
                      "segments": {"type": "array", "items": _ref("Segment")},
                      "language": {"type": "string"},
                  }}
    epoch = {"type": ["number", "null"], "description": "epoch seconds"}
    job = {"type": "object", "required": ["id", "object", "status", "progress", "created_at"],
           "properties": {
               "id": {"type": "string", "pattern": JOB_ID_PATTERN},
               "object": {"const": "transcription.job"},
               "status": {"type": "string", "enum": [s.value for s in JobStatus]},
               "progress": {"type": "number", "minimum": 0, "maximum": 1,
                            "description": "audio done over audio total"},
               "created_at": {"type": "number"}, "updated_at": {"type": "number"},
               "started_at": epoch, "finished_at": epoch,
               "audio_seconds": {"type": "number"}, "attempts": {"type": "integer"},
               "error": _nullable("string"), "language": {"type": "string"},
               "response_format": {"type": "string", "enum": [*FORMATS, DEEPGRAM_FORMAT]},
               "webhook_url": _nullable("string"), "filename": _nullable("string"),
           }}
    job_list = {"type": "object", "required": ["object", "data", "next_cursor", "has_more"],
                "properties": {
                    "object": {"const": "list"},
                    "data": {"type": "array", "items": _ref("Job")},
                    "next_cursor": _nullable("string"), "has_more": {"type": "boolean"},
                }}
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["code", "message"],
        "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
    }}}
    openai_error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string", "enum": ["invalid_request_error", "server_error"]},
            "param": _nullable("string"), "code": _nullable("string"),
        },
    }}}
    return {
        "Word": word, "Segment": segment, "Transcript": transcript, "Job": job,
        "JobList": job_list, "Error": error, "OpenAIError": openai_error,
        "OpenAITranscription": _openai_json(), "OpenAIVerboseTranscription": _openai_verbose(),
        "OpenAIVerboseTranslation": _openai_verbose("translate"),
        **deepgram_openapi.schemas(),
        "Health": {"type": "object", "required": ["status"],
                   "properties": {"status": {"const": "ok"}}},
        "Ready": {"type": "object", "required": ["status"], "properties": {
            "status": {"const": "ready"},
            "realtime_workers": {"type": "integer", "minimum": 1},
            "free_slots": {"type": "integer", "minimum": 0},
        }},
        "Unready": {"type": "object", "required": ["status", "reason", "message"],
                    "properties": {
                        "status": {"const": "unready"},
                        "reason": {"type": "string",
                                   "enum": ["redis_unreachable", "no_realtime_worker"]},
                        "message": {"type": "string"},
                    }},
    }


def _usage() -> Schema:
    return {"type": "object", "required": ["type", "seconds"], "properties": {
        "type": {"const": "duration"}, "seconds": {"type": "integer", "minimum": 0}}}


def _openai_json() -> Schema:
    return {"type": "object", "required": ["text", "usage"],
            "properties": {"text": {"type": "string"}, "usage": _usage()}}


def _openai_verbose(task: str = "transcribe") -> Schema:
    segment = {"type": "object", "required": ["id", "start", "end", "text"], "properties": {
        "id": {"type": "integer"}, "seek": {"type": "integer"},
        "start": {"type": "number"}, "end": {"type": "number"}, "text": {"type": "string"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "temperature": {"type": "number"}, "avg_logprob": {"type": "number"},
        "compression_ratio": {"type": "number"}, "no_speech_prob": {"type": "number"},
    }}
    return {"type": "object", "required": ["task", "language", "duration", "text", "usage"],
            "properties": {
                "task": {"const": task}, "language": {"type": "string"},
                "duration": {"type": "number"}, "text": {"type": "string"},
                "segments": {"type": "array", "items": segment},
                "words": {"type": "array", "items": _ref("Word")},
                "usage": _usage(),
            }}


# --- operations ----------------------------------------------------------------------

#: responses every secured operation can give
def _common(openai: bool = False) -> dict[str, Schema]:
    schema = "OpenAIError" if openai else "Error"
    return {
        "401": _error("missing or invalid API key (only when auth is on)", schema,
                      headers={"WWW-Authenticate": _header("`Bearer realm=\"lanegate\"`")}),
        "503": _error("Redis is unreachable; retry after `Retry-After` seconds",
                      headers={"Retry-After": _header("seconds", {"type": "integer"})}),
    }


def _upload_options() -> dict[str, Schema]:
    return {
        "language": {**LANGUAGE,
                     "description": "language tag such as `en`, `en-US` or `en_US`; absent: "
                                    "detected by the engine (Whisper)"},
        "response_format": {"type": "string", "enum": list(FORMATS), "default": "json"},
        "async": {"type": "string", "enum": ["true", "false"], "default": "false",
                  "description": "queue a batch job even for short audio "
                                 "(also accepted: 1/0, yes/no, on/off)"},
        "webhook_url": {"type": "string", "format": "uri", "maxLength": 2048,
                        "description": "POSTed `{id, status}` when the job ends; implies a job"},
    }


def _result_content() -> Schema:
    content: Schema = {RESULT_TYPES["json"]: {"schema": _ref("Transcript")}}
    for fmt in ("text", "srt", "vtt"):
        content[RESULT_TYPES[fmt]] = {"schema": {"type": "string"}}
    return content


def _create_transcription() -> Schema:
    options = _upload_options()
    form = {"type": "object", "required": ["file"],
            "properties": {"file": {"type": "string", "format": "binary",
                                    "description": "the audio (WAV, FLAC, Ogg/Opus, MP3, "
                                                   "M4A/AAC, WebM, ...)"},
                           **options}}
    lane = _header("the lane that took the request", {"enum": ["realtime", "batch"]})
    return {
        "operationId": "createTranscription",
        "summary": "Transcribe a file: now (short audio) or as a batch job",
        "tags": ["transcriptions"],
        "security": SECURED,
        "parameters": [
            *[_query(name, schema, "for a raw body (a form field wins over it)")
              for name, schema in options.items()],
            {"name": "Idempotency-Key", "in": "header", "required": False,
             "schema": {"type": "string", "minLength": 1, "maxLength": 255},
             "description": "the same key from the same API key returns the same job"},
        ],
        "requestBody": {"required": True, "content": {
            "multipart/form-data": {"schema": form},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "audio/wav": {"schema": {"type": "string", "format": "binary"}},
        }},
        "responses": {
            "200": {"description": "the transcript in `response_format` (short audio, "
                                   "realtime lane)",
                    "headers": {"X-Lanegate-Lane": lane}, "content": _result_content()},
            "202": _json(_ref("Job"), "queued as a batch job", headers={
                "Location": _header("`/v1/transcriptions/{id}`"),
                "X-Lanegate-Lane": lane,
                "Idempotent-Replayed": _header("`true` when an earlier job is returned"),
            }),
            "400": _error("a bad field, an empty or missing file, an unknown field"),
            "413": _error("the upload is over `max_upload_bytes`"),
            "415": _error("unsupported content type or audio format"),
            "422": _error("undecodable audio, or audio over `max_audio_seconds`"),
            "502": _error("the realtime worker failed"),
            "504": _error("the realtime lane did not answer in time"),
            **_common(),
        },
    }


def _list_transcriptions() -> Schema:
    return {
        "operationId": "listTranscriptions",
        "summary": "The caller's jobs, newest first",
        "tags": ["transcriptions"],
        "security": SECURED,
        "parameters": [
            _query("limit", {"type": "integer", "minimum": 1, "maximum": LIST_MAX,
                             "default": LIST_DEFAULT}, "page size"),
            _query("cursor", {"type": "string"}, "`next_cursor` of the previous page"),
        ],
        "responses": {
            "200": _json(_ref("JobList"), "one page of jobs"),
            "400": _error("`limit` out of range or a cursor this API did not return"),
            **_common(),
        },
    }


def _job_id_param() -> Schema:
    return {"name": "job_id", "in": "path", "required": True,
            "schema": {"type": "string"},
            "description": "32 hex digits; anything else, or another key's job, is a 404"}


def _get_transcription() -> Schema:
    return {
        "operationId": "getTranscription",
        "summary": "A job, or with `format` its result",
        "tags": ["transcriptions"],
        "security": SECURED,
        "parameters": [
            _job_id_param(),
            _query("format", {"type": "string", "enum": list(FORMATS)},
                   "return the result in this format instead of the job"),
        ],
        "responses": {
            "200": {"description": "the job, or its result with `format`",
                    "content": {**_result_content(),
                                "application/json": {"schema": {
                                    "oneOf": [_ref("Job"), _ref("Transcript")]}}}},
            "400": _error("unknown `format`"),
            "404": _error("no such job for this API key, or its result is gone"),
            "409": _error("`format` asked before the job completed"),
            **_common(),
        },
    }


def _delete_transcription() -> Schema:
    return {
        "operationId": "cancelTranscription",
        "summary": "Cancel a queued or running job (its audio and result are deleted)",
        "tags": ["transcriptions"],
        "security": SECURED,
        "parameters": [_job_id_param()],
        "responses": {
            "200": _json(_ref("Job"), "the cancelled job"),
            "404": _error("no such job for this API key"),
            "409": _error("the job already ended"),
            **_common(),
        },
    }


def _openai_transcription() -> Schema:
    form = {"type": "object", "required": ["file", "model"], "properties": {
        "file": {"type": "string", "format": "binary"},
        "model": {"type": "string", "minLength": 1,
                  "description": "required; any name (the configured engine runs)"},
        "language": {**LANGUAGE, "description": "absent: detected by the engine (Whisper)"},
        "prompt": {"type": "string", "description": "Whisper's initial prompt"},
        "response_format": {"type": "string", "enum": list(OPENAI_FORMATS),
                            "default": "json"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1,
                        "description": "above 0: Whisper samples"},
        "timestamp_granularities[]": {"type": "array", "items": {
            "type": "string", "enum": ["segment", "word"]},
            "description": "with `verbose_json`"},
        "stream": {"type": "boolean", "default": False,
                   "description": "`true`: server-sent events (`transcript.text.delta`, "
                                  "then `transcript.text.done`); with `json` or `text`"},
    }}
    content: Schema = {"application/json": {"schema": {"oneOf": [
        _ref("OpenAITranscription"), _ref("OpenAIVerboseTranscription")]}}}
    for fmt in ("text", "srt", "vtt"):
        content[RESULT_TYPES[fmt]] = {"schema": {"type": "string"}}
    content["text/event-stream"] = {"schema": {
        "type": "string", "description": "with `stream=true`: `data: {\"type\": "
        "\"transcript.text.delta\", \"delta\"}` events, then `transcript.text.done "
        "{text}`; an error after the first event is `data: {\"error\": {...}}`"}}
    job_header = {"X-Lanegate-Job-Id": _header("the batch job behind the answer")}
    return {
        "operationId": "createOpenAITranscription",
        "summary": "OpenAI-compatible transcription (the `openai` SDK's shape)",
        "tags": ["openai"],
        "security": SECURED,
        "requestBody": {"required": True,
                        "content": {"multipart/form-data": {"schema": form}}},
        "responses": {
            "200": {"description": "the transcript in `response_format`",
                    "headers": job_header, "content": content},
            "400": _error("a bad or missing field (`model`, `file`, ...)", "OpenAIError"),
            "409": _error("the batch job was cancelled", "OpenAIError"),
            "413": _error("the upload is over `max_upload_bytes`", "OpenAIError"),
            "415": _error("not multipart, or an unsupported audio format", "OpenAIError"),
            "422": _error("undecodable or too long audio", "OpenAIError"),
            "500": _error("the batch job failed or its result is gone", "OpenAIError"),
            "502": _error("the realtime worker failed", "OpenAIError"),
            "504": _error("not ready in time; the job named by X-Lanegate-Job-Id goes on",
                          "OpenAIError", headers=job_header),
            **_common(openai=True),
        },
    }


def _openai_translation() -> Schema:
    """``/v1/audio/translations``: the transcription's request and answers, with OpenAI's
    translation fields (no language, stream or granularities)."""
    operation = _openai_transcription()
    form = operation["requestBody"]["content"]["multipart/form-data"]["schema"]
    for name in ("language", "timestamp_granularities[]", "stream"):
        del form["properties"][name]
    content = operation["responses"]["200"]["content"]
    del content["text/event-stream"]
    content["application/json"] = {"schema": {"oneOf": [
        _ref("OpenAITranscription"), _ref("OpenAIVerboseTranslation")]}}
    operation["responses"]["200"]["description"] = \
        "English text (Whisper's translate task) in `response_format`"
    operation.update(operationId="createOpenAITranslation",
                     summary="OpenAI-compatible translation into English (the `openai` "
                             "SDK's `audio.translations`)")
    return operation


def _stream() -> Schema:
    return {
        "operationId": "openStream",
        "summary": "Live transcription over a WebSocket (upgrade request)",
        "description": "Send PCM s16le mono frames at `sample_rate` and `{\"type\":\"end\"}`; "
                       "receive `ready`, `partial`, `final`, `error`, `done` (README, "
                       "\"Streaming protocol\"). Auth errors arrive as an `error` event "
                       "and close 1008.",
        "tags": ["stream"],
        "security": SECURED,
        "parameters": [
            _query("sample_rate", {"type": "integer", "minimum": MIN_SAMPLE_RATE,
                                   "maximum": MAX_SAMPLE_RATE, "default": 16000},
                   "rate of the PCM the client sends"),
            _query("language", LANGUAGE,
                   "language tag; absent: detected by the engine (Whisper)"),
            _query("api_key", {"type": "string"}, "the API key, for clients that cannot "
                                                   "set headers (browsers)"),
        ],
        "responses": {
            "101": {"description": "switching to the WebSocket protocol"},
            "426": _error("a plain GET without `Upgrade: websocket`",
                          headers={"Upgrade": _header("`websocket`")}),
        },
    }


def _realtime() -> Schema:
    return {
        "operationId": "openRealtimeTranscription",
        "summary": "OpenAI Realtime API transcription session (WebSocket upgrade request)",
        "description": "OpenAI's transcription-session events, GA and beta shapes (README, "
                       "\"OpenAI Realtime API\"). Refusals arrive as an `error` event and a "
                       "close code, as on `/v1/stream`.",
        "tags": ["stream"],
        "security": SECURED,
        "parameters": [
            _query("intent", {"type": "string"}, "must be `transcription`: without it, "
                   "or with anything else, the session is refused with an `error` event "
                   "after the upgrade"),
            _query("model", {"type": "string"}, "accepted and ignored"),
        ],
        "responses": {
            "101": {"description": "switching to the WebSocket protocol"},
            "426": _error("a plain GET without `Upgrade: websocket`",
                          headers={"Upgrade": _header("`websocket`")}),
        },
    }


def _plain(summary: str, op_id: str, responses: dict[str, Schema], tag: str) -> Schema:
    return {"operationId": op_id, "summary": summary, "tags": [tag], "responses": responses}


def _page_routes() -> dict[str, Schema]:
    static = {"name": "name", "in": "path", "required": True,
              "schema": {"type": "string", "enum": sorted(STATIC_FILES)}}
    return {
        "/": {"get": _plain("The browser page (microphone streaming and uploads)", "page",
                            {"200": {"description": "HTML",
                                     "content": {"text/html": {"schema": {"type": "string"}}}}},
                            "page")},
        "/static/{name}": {"get": {
            **_plain("The page's script, worklet and style sheet", "pageAsset", {
                "200": {"description": "the file", "content": {
                    media: {"schema": {"type": "string"}}
                    for media in sorted(set(STATIC_FILES.values()))}},
                "404": _error("no such file"),
            }, "page"),
            "parameters": [static]}},
        PATH: {"get": _plain("This document", "openapi", {
            "200": _json({"type": "object"}, "OpenAPI 3.1")}, "meta")},
        "/status": {"get": _plain("The live lane status page (charts drawn from /status.json)",
                                  "statusPage", {"200": {"description": "HTML", "content": {
                                      "text/html": {"schema": {"type": "string"}}}}}, "page")},
        "/status.js": {"get": _plain("The status page's script", "statusScript", {
            "200": {"description": "JavaScript", "content": {
                "text/javascript": {"schema": {"type": "string"}}}}}, "page")},
        "/status.json": {"get": _plain(
            "Each lane's latency and step percentiles, sessions and free slots, queue depth "
            "and oldest job age, and whether this traffic would gain from the split",
            "status", {"200": _json({"type": "object"}, "the figures")}, "page")},
    }


def _health_routes() -> dict[str, Schema]:
    return {
        "/healthz": {"get": _plain("The process answers", "healthz",
                                   {"200": _json(_ref("Health"), "alive")}, "health")},
        "/readyz": {"get": _plain("Redis answers and a realtime worker is alive", "readyz", {
            "200": _json(_ref("Ready"), "ready"),
            "503": _json(_ref("Unready"), "not ready, with the reason",
                         headers={"Retry-After": _header("seconds", {"type": "integer"})}),
        }, "health")},
        "/metrics": {"get": _plain("Prometheus metrics", "metrics", {
            "200": {"description": "Prometheus text format 0.0.4",
                    "content": {"text/plain": {"schema": {"type": "string"}}}}}, "health")},
    }


def _with_http_layer_400(paths: dict[str, Schema]) -> dict[str, Schema]:
    """aiohttp's HTTP parser refuses a request line or header over 8190 bytes before any
    handler runs, with a plain-text 400: every operation that takes input can get it."""
    for item in paths.values():
        for operation in item.values():
            if "parameters" not in operation and "requestBody" not in operation:
                continue
            response = operation["responses"].setdefault(
                "400", {"description": "a request line or header over 8190 bytes",
                        "content": {}})
            response["content"]["text/plain"] = {"schema": {"type": "string"}}
    return paths


def build() -> Schema:
    """The whole document (a fresh dict)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "lanegate",
            "version": VERSION,
            "description": "ASR gateway: live streams over a WebSocket, uploads as "
                           "realtime answers or batch jobs, an OpenAI-compatible endpoint. "
                           "Errors are JSON `{\"error\": {\"code\", \"message\"}}` "
                           "(OpenAI's shape on `/v1/audio/*`). Auth applies "
                           "only when `LANEGATE_API_KEYS` is set.",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "paths": _with_http_layer_400({
            "/v1/transcriptions": {"post": _create_transcription(),
                                   "get": _list_transcriptions()},
            "/v1/transcriptions/{job_id}": {"get": _get_transcription(),
                                            "delete": _delete_transcription()},
            "/v1/audio/transcriptions": {"post": _openai_transcription()},
            "/v1/audio/translations": {"post": _openai_translation()},
            "/v1/stream": {"get": _stream()},
            "/v1/realtime": {"get": _realtime()},
            **deepgram_openapi.paths(),
            **_health_routes(),
            **_page_routes(),
        }),
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer",
                           "description": "an API key from `LANEGATE_API_KEYS`"},
                "apiKeyQuery": {"type": "apiKey", "in": "query", "name": "api_key"},
            },
        },
    }


@functools.cache
def _body() -> bytes:
    return json.dumps(build(), indent=1).encode()


async def openapi_handler(request: web.Request) -> web.Response:
    return web.Response(body=_body(), content_type="application/json")


def setup_openapi(app: web.Application) -> None:
    app.router.add_get(PATH, openapi_handler)
