"""``/v1/listen``'s part of ``/openapi.json`` (``gateway/openapi.py``): Deepgram's live
upgrade request and prerecorded POST, with Deepgram's response and error shapes."""

from __future__ import annotations

from typing import Any

from gateway.deepgram_params import ENCODINGS
from lanegate.audio import MAX_STREAM_SAMPLE_RATE, MIN_STREAM_SAMPLE_RATE

Schema = dict[str, Any]
SECURED: list[dict[str, list[str]]] = [{"bearer": []}, {"apiKeyQuery": []}]
TAG = "deepgram"


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _query(name: str, schema: Schema, description: str) -> Schema:
    return {"name": name, "in": "query", "required": False, "schema": schema,
            "description": description}


def _error(description: str, schema: str = "DeepgramError") -> Schema:
    return {"description": description, "content": {"application/json": {"schema":
                                                                          _ref(schema)}},
            "headers": {"dg-error": {"description": "the message again",
                                     "schema": {"type": "string"}},
                        "dg-request-id": {"description": "the request id",
                                          "schema": {"type": "string"}}}}


def schemas() -> dict[str, Schema]:
    """The component schemas ``/v1/listen`` refers to."""
    word = {"type": "object", "required": ["word", "start", "end", "confidence"],
            "properties": {"word": {"type": "string"}, "punctuated_word": {"type": "string"},
                           "start": {"type": "number"}, "end": {"type": "number"},
                           "confidence": {"type": "number"}, "language": {"type": "string"}}}
    alternative = {"type": "object", "required": ["transcript", "confidence", "words"],
                   "properties": {"transcript": {"type": "string"},
                                  "confidence": {"type": "number"},
                                  "words": {"type": "array", "items": word},
                                  "languages": {"type": "array",
                                                "items": {"type": "string"}}}}
    response = {"type": "object", "required": ["metadata", "results"], "properties": {
        "metadata": {"type": "object",
                     "required": ["request_id", "created", "duration", "channels"],
                     "properties": {"request_id": {"type": "string"},
                                    "created": {"type": "string"},
                                    "duration": {"type": "number"},
                                    "channels": {"type": "integer"},
                                    "models": {"type": "array", "items": {"type": "string"}},
                                    "model_info": {"type": "object"}}},
        "results": {"type": "object", "required": ["channels"], "properties": {
            "channels": {"type": "array", "items": {"type": "object", "properties": {
                "alternatives": {"type": "array", "items": alternative},
                "detected_language": {"type": "string"}}}}}}}}
    return {
        "DeepgramResponse": response,
        "DeepgramAccepted": {"type": "object", "required": ["request_id"],
                             "properties": {"request_id": {"type": "string"}}},
        "DeepgramError": {"type": "object", "required": ["err_code", "err_msg", "request_id"],
                          "properties": {"err_code": {"type": "string"},
                                         "err_msg": {"type": "string"},
                                         "request_id": {"type": "string"}}},
    }


def _params(*, live: bool) -> list[Schema]:
    params = [
        _query("encoding", {"type": "string", "enum": list(ENCODINGS)},
               "raw audio's encoding" + ("" if live else "; on POST leave it out and send "
                                         "a file")),
        _query("sample_rate", {"type": "integer", "minimum": MIN_STREAM_SAMPLE_RATE,
                               "maximum": MAX_STREAM_SAMPLE_RATE},
               "the raw audio's rate (required with `encoding`)"),
        _query("language", {"type": "string"}, "a language tag; absent or `multi`: "
               "detected"),
        _query("keyterm", {"type": "string"}, "a term for Whisper's prompt (repeatable)"),
        _query("model", {"type": "string"}, "accepted and ignored"),
        _query("api_key", {"type": "string"}, "the API key, for clients that cannot set "
               "headers"),
    ]
    if live:
        params += [
            _query("channels", {"type": "integer", "minimum": 1},
                   "interleaved channels (at most `max_stream_channels`)"),
            _query("multichannel", {"type": "string", "enum": ["true", "false"]},
                   "each channel its own session"),
            _query("interim_results", {"type": "string", "enum": ["true", "false"]},
                   "send partial results"),
            _query("endpointing", {"type": "string"}, "ms of silence, or `false`"),
            _query("utterance_end_ms", {"type": "integer", "minimum": 1000},
                   "send `UtteranceEnd` after this much audio past the last word"),
            _query("vad_events", {"type": "string", "enum": ["true", "false"]},
                   "send `SpeechStarted`"),
        ]
    else:
        params.append(_query("callback", {"type": "string", "format": "uri"},
                             "a batch job whose result is POSTed here (a webhook)"))
    return params


def paths() -> dict[str, Schema]:
    """``/v1/listen``'s path item."""
    binary = {"schema": {"type": "string", "format": "binary"}}
    listen = {
        "operationId": "openDeepgramListen",
        "summary": "Deepgram's live transcription API (WebSocket upgrade request)",
        "description": "Binary audio frames and `KeepAlive`/`Finalize`/`CloseStream`; "
                       "`Results`, `SpeechStarted`, `UtteranceEnd`, `Metadata` out (README, "
                       "\"Deepgram API\"). The key also as `Authorization: Token KEY` or "
                       "`Sec-WebSocket-Protocol: token, KEY`.",
        "tags": [TAG], "security": SECURED, "parameters": _params(live=True),
        "responses": {
            "101": {"description": "switching to the WebSocket protocol"},
            "426": _error("a plain GET without `Upgrade: websocket`"),
        },
    }
    transcribe = {
        "operationId": "createDeepgramTranscription",
        "summary": "Deepgram's prerecorded transcription: the body is the audio file",
        "tags": [TAG], "security": SECURED, "parameters": _params(live=False),
        "requestBody": {"required": True, "content": {
            "application/octet-stream": binary, "audio/wav": binary}},
        "responses": {
            "200": {"description": "Deepgram's response; with `callback`, the request id",
                    "content": {"application/json": {"schema": {"oneOf": [
                        _ref("DeepgramResponse"), _ref("DeepgramAccepted")]}}}},
            "400": _error("a bad or refused parameter (`diarize`, `redact`, `multichannel`), "
                          "a JSON body (no URL fetching), an empty body"),
            "401": _error("missing or invalid API key (only when auth is on)"),
            "408": _error("the body stalled"),
            "413": _error("the upload is over `max_upload_bytes`"),
            "415": _error("unsupported content type or audio format"),
            "422": _error("undecodable audio, or audio over `max_audio_seconds`"),
            "429": _error("the key's job quota is reached"),
            "500": _error("the batch job failed"),
            "502": _error("the realtime worker failed"),
            "503": _error("Redis is unreachable", "Error"),
            "504": _error("no transcript in time"),
            "507": _error("too little free disk for uploads"),
        },
    }
    return {"/v1/listen": {"get": listen, "post": transcribe}}
