"""Request parameters that more than one endpoint takes, each checked one way.

A language is a BCP-47-like tag: a primary subtag of 2-3 letters, then any
number of 1-8 letter-or-digit subtags joined by ``-`` or ``_`` (``en``,
``en-US``, ``en_US``, ``zh-Hant-TW``). Tags are case-insensitive, so the value
kept is lowercase with ``-`` (``en_US`` becomes ``en-us``). No language (absent or
empty) is ``NO_LANGUAGE``, the empty string, everywhere (stream, link op, job hash):
the engine then detects it (Whisper) or ignores it (English-only engines). A bad value is an
:class:`~gateway.intake.UploadError` (400) naming the parameter; the stream
endpoint sends its message as a ``bad_request`` event.
"""

from __future__ import annotations

import re

from gateway.intake import UploadError
from lanegate.audio import MAX_STREAM_SAMPLE_RATE, MIN_STREAM_SAMPLE_RATE

NO_LANGUAGE = ""  # detect it
DEFAULT_SAMPLE_RATE = 16000

#: what a ``language`` parameter may be, as sent: this is the rule, and the OpenAPI
#: document (``gateway/openapi.py``) publishes it as the parameter's pattern
#: (ECMA-262 and Python read it alike). Empty (or blank): no language.
LANGUAGE_PATTERN = r"^\s*([A-Za-z]{2,3}([-_][A-Za-z0-9]{1,8})*)?\s*$"
_LANGUAGE = re.compile(LANGUAGE_PATTERN)
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def parse_language(raw: str | None, *, param: str = "language") -> str:
    """The tag, normalized, or ``NO_LANGUAGE`` when none is given."""
    if raw and not _LANGUAGE.match(raw):
        raise UploadError(400, "invalid_language",
                          f"language {raw!r} is not a language tag such as `en`, `en-US` "
                          "or `en_US`", param=param)
    return (raw or NO_LANGUAGE).strip().lower().replace("_", "-")


def parse_sample_rate(raw: str | None, *, param: str = "sample_rate") -> int:
    try:
        rate = DEFAULT_SAMPLE_RATE if raw is None else int(raw)
    except ValueError:
        raise UploadError(400, "invalid_sample_rate",
                          f"sample_rate must be an integer, got {raw!r}", param=param) from None
    if not MIN_STREAM_SAMPLE_RATE <= rate <= MAX_STREAM_SAMPLE_RATE:
        raise UploadError(400, "invalid_sample_rate",
                          f"sample_rate must be {MIN_STREAM_SAMPLE_RATE}-"
                          f"{MAX_STREAM_SAMPLE_RATE}, got {rate}", param=param)
    return rate


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
