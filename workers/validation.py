"""What a gateway may ask of a realtime worker: the checks that the per-session
endpoint (``workers/realtime.py``) and the multiplexed link (``workers/link.py``)
both apply to a session's parameters, audio and ``end``."""

from __future__ import annotations

import json
import uuid

from lanegate.constants import CLOSE_OVERLOADED, CLOSE_POLICY

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


def audio_problem(data: bytes, ended: bool) -> str | None:
    if ended:
        return "audio after end"
    if len(data) % 2:
        return f"PCM s16le needs an even byte count, got {len(data)}"
    return None


def end_problem(ended: bool) -> str | None:
    return "end sent twice" if ended else None


def control_problem(data: str) -> str | None:
    """A per-session endpoint's text frame must be ``{"type":"end"}`` (once: that is
    ``end_problem``)."""
    try:
        message = json.loads(data)
    except ValueError:
        return "text frames must be JSON"
    if not isinstance(message, dict) or message.get("type") != "end":
        return "unknown control message; expected {\"type\":\"end\"}"
    return None
