"""The query parameters and credentials of Deepgram's ``/v1/listen``, checked one way for
the live (WebSocket) and the prerecorded (POST) API.

Honoured: ``encoding`` (``linear16``, ``mulaw``, ``alaw``), ``sample_rate``,
``channels``, ``multichannel``, ``interim_results``, ``endpointing`` (ms of
trailing silence, or ``false``), ``utterance_end_ms``, ``vad_events``,
``language`` (absent or ``multi``: detected) and ``keyterm``/``keywords`` (joined
into Whisper's prompt); ``callback`` and ``callback_method`` on POST. ``diarize``,
``diarize_model`` and ``redact`` are refused: lanegate cannot do them and a caller
relying on them must know. Everything else (``punctuate``, ``smart_format``,
``model``, ...: the table in the README) is accepted and ignored.

A bad value is a :class:`ParamError`, answered in Deepgram's REST error shape before
any WebSocket upgrade (``params_or_400``), as is a missing or wrong key
(``check_key``).
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from aiohttp import web

from gateway.auth import api_key_of, authenticate
from gateway.intake import UploadError
from gateway.params import parse_bool, parse_language
from gateway.state import SETTINGS
from lanegate.audio import MAX_STREAM_SAMPLE_RATE, MIN_STREAM_SAMPLE_RATE
from lanegate.deepgram_response import error_body
from lanegate.settings import Settings

#: the live encodings lanegate decodes, each to PCM s16le
ENCODINGS = ("linear16", "mulaw", "alaw")
#: Deepgram's own floor for ``utterance_end_ms``
MIN_UTTERANCE_END_MS = 1000
#: ``language`` values that mean "detect it"
DETECTED = frozenset({"", "multi"})
#: refused: lanegate cannot do them
REFUSED = {"diarize": "speaker diarization", "diarize_model": "speaker diarization",
           "redact": "redaction"}
#: parameters Deepgram takes that lanegate accepts and ignores (README's table)
IGNORED = ("punctuate", "smart_format", "model", "version", "tier", "numerals",
           "profanity_filter", "dictation", "filler_words", "measurements", "paragraphs",
           "utterances", "utt_split", "detect_entities", "detect_language", "language_hint",
           "tag", "mip_opt_out", "extra", "replace", "search", "no_delay", "alternatives",
           "topics", "intents", "sentiment", "summarize")
#: the subprotocol a browser names before its key (``Sec-WebSocket-Protocol: token, KEY``)
TOKEN_PROTOCOL = "token"
#: Deepgram's ``err_code`` by HTTP status; other statuses say lanegate's own code
ERR_CODES = {400: "Bad Request", 401: "INVALID_AUTH", 403: "INSUFFICIENT_PERMISSIONS",
             413: "PAYLOAD_TOO_LARGE", 429: "TOO_MANY_REQUESTS"}


class ParamError(Exception):
    """A parameter Deepgram's API would refuse (HTTP 400), or one lanegate cannot honour."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class DeepgramParams:
    encoding: str | None  # None: a container (prerecorded only)
    sample_rate: int
    channels: int
    multichannel: bool
    interim_results: bool
    vad_events: bool
    #: the worker's ``vad`` override: {} the worker's default; ``endpoint_silence_ms``
    #: None: endpointing off (a final only at Finalize, the soft cut or the end)
    vad: dict[str, int | None]
    utterance_end_ms: int | None
    language: str  # "": detected
    multi: bool  # ``language=multi``: results name the language
    prompt: str  # keyterms for Whisper's prompt
    callback: str | None = None

    @property
    def sessions(self) -> int:
        """Realtime sessions this stream needs: one per channel with ``multichannel``."""
        return self.channels if self.multichannel else 1


def _get(request: web.Request, name: str) -> str | None:
    return request.query.get(name)


def _int(raw: str, param: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ParamError(param, f"{param} must be an integer, not {raw!r}") from None


def _bool(request: web.Request, name: str, default: bool = False) -> bool:
    raw = _get(request, name)
    if raw is None:
        return default
    try:
        return parse_bool(raw, param=name)
    except UploadError as exc:
        raise ParamError(name, exc.message) from None


def _refuse_unsupported(request: web.Request) -> None:
    for name, what in REFUSED.items():
        raw = _get(request, name)
        if raw is None or raw.strip().lower() in ("", "false", "0"):
            continue
        raise ParamError(name, f"{name}={raw} is not supported: lanegate does no {what}; "
                         f"leave {name} out")


def _encoding(request: web.Request, *, live: bool) -> str | None:
    raw = _get(request, "encoding")
    if raw is None:
        if live:
            raise ParamError("encoding", "a live stream needs encoding (linear16, mulaw or "
                             "alaw) and sample_rate: lanegate takes raw audio on the live API")
        return None
    value = raw.strip().lower()
    if value not in ENCODINGS:
        raise ParamError("encoding", f"encoding {raw!r} is not supported: use linear16, "
                         "mulaw or alaw (or, on POST, send a file with no encoding)")
    return value


def _sample_rate(request: web.Request, encoding: str | None) -> int:
    raw = _get(request, "sample_rate")
    if raw is None:
        if encoding is not None:
            raise ParamError("sample_rate", f"encoding={encoding} needs sample_rate")
        return 16000
    rate = _int(raw, "sample_rate")
    if not MIN_STREAM_SAMPLE_RATE <= rate <= MAX_STREAM_SAMPLE_RATE:
        raise ParamError("sample_rate", f"sample_rate must be {MIN_STREAM_SAMPLE_RATE}-"
                         f"{MAX_STREAM_SAMPLE_RATE}, got {rate}")
    return rate


def _vad(request: web.Request, settings: Settings) -> dict[str, int | None]:
    raw = _get(request, "endpointing")
    if raw is None or raw.strip().lower() == "true":
        return {}
    if raw.strip().lower() == "false":
        return {"endpoint_silence_ms": None}
    ms = _int(raw, "endpointing")
    if ms < 0:
        raise ParamError("endpointing", "endpointing is milliseconds of silence (>= 0) or false")
    return {"endpoint_silence_ms": max(ms, settings.deepgram_min_endpointing_ms)}


def _utterance_end(request: web.Request) -> int | None:
    raw = _get(request, "utterance_end_ms")
    if raw is None:
        return None
    ms = _int(raw, "utterance_end_ms")
    if ms < MIN_UTTERANCE_END_MS:
        raise ParamError("utterance_end_ms", f"utterance_end_ms must be at least "
                         f"{MIN_UTTERANCE_END_MS}, got {ms}")
    return ms


def _prompt(request: web.Request) -> str:
    """``keyterm`` values as they are, ``keywords`` without their ``:boost``."""
    terms: list[str] = []
    for raw in request.query.getall("keyterm", []):
        terms.append(raw.strip())
    for raw in request.query.getall("keywords", []):
        word, _, boost = raw.rpartition(":")
        terms.append((word if word and _is_number(boost) else raw).strip())
    unique = dict.fromkeys(t for t in terms if t)
    return ", ".join(unique)


def _is_number(raw: str) -> bool:
    try:
        float(raw)
    except ValueError:
        return False
    return True


def _language(request: web.Request) -> tuple[str, bool]:
    raw = (_get(request, "language") or "").strip()
    if raw.lower() in DETECTED:
        return "", raw.lower() == "multi"
    try:
        return parse_language(raw), False
    except UploadError as exc:
        raise ParamError("language", exc.message) from None


def parse_params(request: web.Request, settings: Settings, *, live: bool) -> DeepgramParams:
    """The request's parameters; :class:`ParamError` for the first bad one."""
    _refuse_unsupported(request)
    encoding = _encoding(request, live=live)
    channels = _int(_get(request, "channels") or "1", "channels")
    if not 1 <= channels <= settings.max_stream_channels:
        raise ParamError("channels", f"channels must be 1-{settings.max_stream_channels} "
                         f"(max_stream_channels), got {channels}")
    multichannel = _bool(request, "multichannel")
    if not live and (channels > 1 or multichannel):
        raise ParamError("multichannel", "prerecorded audio is transcribed as one channel "
                         "(the upload path mixes channels down); stream multichannel audio "
                         "over the live API (WebSocket /v1/listen) instead")
    language, multi = _language(request)
    callback = _get(request, "callback")
    if callback is not None and live:
        raise ParamError("callback", "callback is for prerecorded audio (POST /v1/listen); "
                         "a live stream sends its results on the WebSocket")
    method = (_get(request, "callback_method") or "post").strip().lower()
    if method != "post":
        raise ParamError("callback_method", "lanegate POSTs callbacks: callback_method must "
                         "be post")
    return DeepgramParams(
        encoding=encoding, sample_rate=_sample_rate(request, encoding), channels=channels,
        multichannel=multichannel, interim_results=_bool(request, "interim_results"),
        vad_events=_bool(request, "vad_events"), vad=_vad(request, settings),
        utterance_end_ms=_utterance_end(request), language=language, multi=multi,
        prompt=_prompt(request), callback=callback.strip() if callback else None)


def presented_key(request: web.Request) -> str | None:
    """The API key as a Deepgram client presents it: ``Authorization: Token KEY`` (the
    SDK's) or ``Bearer KEY``, or ``Sec-WebSocket-Protocol: token, KEY`` (browsers, which
    cannot set headers); else ``?api_key=`` as everywhere."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() in ("token", "bearer") and token.strip():
        return token.strip()
    offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
    if len(offered) >= 2 and hmac.compare_digest(offered[0].lower(), TOKEN_PROTOCOL) \
            and offered[1]:
        return offered[1]
    return api_key_of(request)


def http_error(status: int, code: str, message: str, rid: str,
               headers: dict[str, str] | None = None) -> web.HTTPException:
    """An HTTP error in Deepgram's shape, the message also in ``dg-error``."""
    err = web.HTTPException(
        text=json.dumps(error_body(ERR_CODES.get(status, code), message, rid)),
        content_type="application/json",
        headers={"dg-error": message[:500], "dg-request-id": rid, **(headers or {})})
    err.set_status(status)
    return err


def check_key(request: web.Request, rid: str) -> str:
    """The caller's tenant; a 401 in Deepgram's shape for a missing or wrong key."""
    tenant = authenticate(request, presented_key(request))
    if tenant is None:
        raise http_error(401, "INVALID_AUTH", "Invalid credentials: pass a lanegate API key "
                         "as `Authorization: Token KEY`", rid,
                         {"WWW-Authenticate": 'Token realm="lanegate"'})
    return tenant


def params_or_400(request: web.Request, rid: str, *, live: bool) -> DeepgramParams:
    """``parse_params``; a 400 in Deepgram's shape for a bad parameter."""
    try:
        return parse_params(request, request.app[SETTINGS], live=live)
    except ParamError as exc:
        raise http_error(400, "Bad Request", exc.message, rid) from None
