"""Deepgram's transcript shapes, rendered from lanegate's words and transcripts.

One place for what both sides of the Deepgram API send (README, "Deepgram API"):
the live ``Results`` message's alternative (``gateway/deepgram.py``), the
prerecorded response of ``POST /v1/listen`` (the gateway's synchronous answer) and
the body a Deepgram ``callback`` job's webhook POSTs (``lanegate/webhooks.py``, run
by the batch worker: hence here, below both).

lanegate's engines give no per-word confidence: every ``confidence`` is 1.0. A
``word`` is the spoken word in lower case without punctuation, its
``punctuated_word`` the engine's own spelling, as Deepgram gives them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from lanegate.transcript import Transcript, Word

#: a job's ``response_format`` when it is a Deepgram ``callback`` job: its webhook POSTs
#: the Deepgram response instead of lanegate's ``{"id", "status"}``
DEEPGRAM_FORMAT = "deepgram"
#: the model name lanegate reports in ``metadata`` (any ``model`` asked for is ignored)
MODEL_NAME = "lanegate"
MODEL_INFO = {"name": MODEL_NAME, "version": "1", "arch": "lanegate"}
#: the ``model_uuid`` Deepgram's messages carry; lanegate has one "model"
MODEL_UUID = str(uuid.uuid5(uuid.NAMESPACE_URL, "https://github.com/lanegate/lanegate"))
#: what Deepgram's word strips from the punctuated spelling
PUNCTUATION = ".,!?;:\"()[]{}¿¡…"
CONFIDENCE = 1.0


def request_id(raw: str) -> str:
    """A lanegate id (32 hex digits) in Deepgram's UUID form; anything else unchanged."""
    try:
        return str(uuid.UUID(hex=raw))
    except ValueError:
        return raw


def created_now() -> str:
    """Deepgram's ``created``: ISO 8601 UTC."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def dg_word(spelled: str, start: float, end: float) -> dict[str, Any]:
    """One word of an alternative."""
    spelled = spelled.strip()
    bare = spelled.strip(PUNCTUATION).lower() or spelled.lower()
    return {"word": bare, "start": round(start, 3), "end": round(end, 3),
            "confidence": CONFIDENCE, "punctuated_word": spelled}


def timed_words(words: Iterable[Word | dict[str, Any]]) -> list[dict[str, Any]]:
    """The engine's timed words (``Word`` or a final event's dicts) in Deepgram's shape."""
    out = []
    for w in words:
        if isinstance(w, Word):
            out.append(dg_word(w.word, w.start, w.end))
        elif str(w.get("word", "")).strip():
            out.append(dg_word(str(w["word"]), float(w.get("start", 0.0)),
                               float(w.get("end", 0.0))))
    return out


def spread_words(text: str, start: float, end: float) -> list[dict[str, Any]]:
    """Words for a hypothesis without timings (a live interim result): ``text``'s words
    spread evenly over ``start``-``end``."""
    spelled = text.split()
    if not spelled:
        return []
    step = max(0.0, end - start) / len(spelled)
    return [dg_word(w, start + i * step, start + (i + 1) * step) for i, w in enumerate(spelled)]


def alternative(transcript: str, words: list[dict[str, Any]],
                language: str | None = None) -> dict[str, Any]:
    """``channel.alternatives[0]`` of a live result, or of a prerecorded channel."""
    alt: dict[str, Any] = {"transcript": transcript.strip(),
                           "confidence": CONFIDENCE if transcript.strip() else 0.0,
                           "words": words}
    if language:
        alt["languages"] = [language]
        for word in words:
            word["language"] = language
    return alt


def metadata(*, rid: str, created: str, duration: float, channels: int,
             sha256: str = "") -> dict[str, Any]:
    """The ``metadata`` of a prerecorded response."""
    meta: dict[str, Any] = {
        "transaction_key": "deprecated", "request_id": rid, "created": created,
        "duration": round(duration, 3), "channels": channels, "models": [MODEL_UUID],
        "model_info": {MODEL_UUID: MODEL_INFO}}
    if sha256:
        meta["sha256"] = sha256
    return meta


def prerecorded(transcript: Transcript, *, rid: str, created: str, sha256: str = "",
                detected: bool = False) -> dict[str, Any]:
    """``POST /v1/listen``'s answer: ``metadata``, then one channel's alternative with
    its words. ``detected``: the language was detected (``language`` none or ``multi``),
    so the channel says which."""
    words = timed_words(w for seg in transcript.segments for w in seg.words)
    channel: dict[str, Any] = {"alternatives": [alternative(transcript.text, words)]}
    if detected:
        channel["detected_language"] = transcript.language
        channel["language_confidence"] = CONFIDENCE
    return {"metadata": metadata(rid=rid, created=created, duration=transcript.duration,
                                 channels=1, sha256=sha256),
            "results": {"channels": [channel]}}


def error_body(err_code: str, message: str, rid: str) -> dict[str, Any]:
    """Deepgram's REST error body."""
    return {"err_code": err_code, "err_msg": message, "request_id": rid}


def callback_body(job_id: str, status: str, result: str | bytes | None,
                  created: str | None = None) -> bytes:
    """What a Deepgram callback job's webhook POSTs: the prerecorded response of a
    completed job (``result``: its stored transcript JSON), else Deepgram's error body."""
    rid = request_id(job_id)
    if status == "completed" and result is not None:
        transcript = Transcript.from_dict(json.loads(result))
        body = prerecorded(transcript, rid=rid, created=created or created_now())
    else:
        body = error_body("TRANSCRIPTION_FAILED", f"the transcription job is {status}", rid)
    return json.dumps(body, separators=(",", ":")).encode()
