"""What a gateway may ask of a realtime worker: the checks that the per-session
endpoint (``workers/realtime.py``) and the multiplexed link (``workers/link.py``)
both apply to a session's parameters, audio and ``end``."""

from __future__ import annotations

import dataclasses
import hmac
import json
import uuid
from collections.abc import Mapping

from lanegate.addresses import is_loopback_host
from lanegate.constants import CLOSE_OVERLOADED, CLOSE_POLICY, INTERNAL_TOKEN_HEADER
from lanegate.settings import Settings
from lanes.session import RealtimeSession
from vad import VadError, VadSettings

MIN_RATE, MAX_RATE = 8000, 48000


class Refused(Exception):
    """The worker will not open this session: an ``error`` event with ``code``."""

    def __init__(self, code: str, message: str, close_code: int) -> None:
        super().__init__(message)
        self.code = code
        self.close_code = close_code


class BadRequest(Refused):
    def __init__(self, message: str) -> None:
        super().__init__("bad_request", message, CLOSE_POLICY)


class Overloaded(Refused):
    def __init__(self, message: str) -> None:
        super().__init__("overloaded", message, CLOSE_OVERLOADED)


class SessionExists(Refused):
    """A session with this id is live on the worker: the new one is refused and the
    live one is left alone (ids are the gateway's; a clash is a bug or an attack)."""

    def __init__(self, session_id: str) -> None:
        super().__init__("session_exists", f"session {session_id!r} is already live here",
                         CLOSE_POLICY)


def token_ok(settings: Settings, headers: Mapping[str, str]) -> bool:
    """Whether a request to ``/internal/v1/*`` carries the deployment's token
    (always, when none is set)."""
    if not settings.internal_token:
        return True
    given = headers.get(INTERNAL_TOKEN_HEADER, "")
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                               settings.internal_token.encode())


def token_refusal(settings: Settings) -> str | None:
    """Why a realtime worker must not start with these settings, or None: without a
    token its internal endpoints would accept anyone who reaches a network address."""
    if settings.internal_token or is_loopback_host(settings.worker_host):
        return None
    return (f"refusing to serve /internal/v1/* on {settings.worker_host!r}, which is not a "
            "loopback address, without an internal token: set LANEGATE_INTERNAL_TOKEN "
            "(the same value for the gateway and its workers)")


def session_params(session_id: object, sample_rate: object) -> tuple[str, int]:
    """``(session_id, sample_rate)`` from a query string's or an ``open`` op's values
    (``None`` where absent); a missing id is made up, the rate defaults to 16 kHz."""
    if session_id is not None and not isinstance(session_id, str):
        raise BadRequest("session_id must be a string")
    if sample_rate is None:
        sample_rate = "16000"
    try:
        if isinstance(sample_rate, bool):
            raise ValueError
        rate = int(str(sample_rate))
    except ValueError:
        raise BadRequest("sample_rate must be an integer") from None
    if not MIN_RATE <= rate <= MAX_RATE:
        raise BadRequest(f"sample_rate must be {MIN_RATE}-{MAX_RATE} Hz, got {rate}")
    return session_id or uuid.uuid4().hex, rate


#: the VAD fields an ``open`` op may set for its session
VAD_FIELDS = ("aggressiveness", "pad_ms", "endpoint_silence_ms")


def session_vad(raw: object, base: VadSettings) -> VadSettings:
    """The session's VAD: ``base`` with an ``open`` op's ``vad`` object applied.

    ``endpoint_silence_ms: null`` turns endpointing off: a segment then ends only at
    a commit, the max-window soft cut or the end of the audio.
    """
    if raw is None:
        return base
    if not isinstance(raw, dict) or set(raw) - set(VAD_FIELDS):
        raise BadRequest(f"vad must be an object with some of {', '.join(VAD_FIELDS)}")
    changes: dict[str, int] = {}
    for name, value in raw.items():
        if value is None and name == "endpoint_silence_ms":
            value = int(base.max_window_s * 1000) + base.frame_ms  # never before the cut
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequest(f"vad.{name} must be an integer")
        changes[name] = value
    try:
        return dataclasses.replace(base, **changes)
    except VadError as exc:
        raise BadRequest(f"vad: {exc}") from None


def audio_problem(data: bytes, ended: bool) -> str | None:
    if ended:
        return "audio after end"
    if len(data) % 2:
        return f"PCM s16le needs an even byte count, got {len(data)}"
    return None


def memory_problem(session: RealtimeSession, settings: Settings) -> str | None:
    """Why a session holds more of the worker's memory than it may, or None."""
    if session.undecoded_s > settings.max_undecoded_s:
        return (f"{session.undecoded_s:.0f} s of audio are waiting for the decoder "
                f"(max_undecoded_s = {settings.max_undecoded_s:g}): send audio no faster "
                "than real time")
    if session.arrivals_logged > settings.max_arrival_log:
        return (f"audio arrived in more than {settings.max_arrival_log} separate pieces "
                "ahead of the decoder (max_arrival_log): send larger frames")
    return None


def end_problem(ended: bool) -> str | None:
    return "end sent twice" if ended else None


def control_problem(data: str) -> str | None:
    """A per-session endpoint's text frame must be ``{"type":"end"}`` (once: that is
    ``end_problem``)."""
    try:
        message = json.loads(data)
    except RecursionError:
        return "the control message nests too deep"
    except ValueError:
        return "text frames must be JSON"
    if not isinstance(message, dict) or message.get("type") != "end":
        return "unknown control message; expected {\"type\":\"end\"}"
    return None
