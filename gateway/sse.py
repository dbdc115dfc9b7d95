"""Server-sent events (``text/event-stream``) for a transcript that grows: OpenAI's
streamed transcription events.

``TextStream`` sends ``transcript.text.delta {delta}`` each time the text decoded so
far grows, then ``transcript.text.done {text}``. The response starts at the first
event, so a request refused before anything was decoded still gets its plain HTTP
error; an error after that is an event ``{"error": {...}}``, which the ``openai``
SDK raises as ``APIError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

CONTENT_TYPE = "text/event-stream"


class TextStream:
    """One streamed transcription's response (module docstring)."""

    def __init__(self, request: web.Request, headers: Mapping[str, str]) -> None:
        self.request = request
        self.headers = dict(headers)
        self.response: web.StreamResponse | None = None
        self.sent = ""  # the text the deltas have sent so far

    @property
    def started(self) -> bool:
        return self.response is not None

    async def grow(self, text: str) -> None:
        """The text decoded so far; the part beyond what was sent goes out as a delta.
        (A text that no longer extends what was sent, from a retried job say, waits for
        ``done``, which carries the whole text.)"""
        if len(text) > len(self.sent) and text.startswith(self.sent):
            delta, self.sent = text[len(self.sent):], text
            await self._event({"type": "transcript.text.delta", "delta": delta})

    async def done(self, text: str) -> web.StreamResponse:
        await self.grow(text)
        await self._event({"type": "transcript.text.done", "text": text})
        return await self._finish()

    async def error(self, body: dict[str, Any]) -> web.StreamResponse:
        """An error once the stream has started (``body`` is OpenAI's error body)."""
        await self._event(body)
        return await self._finish()

    async def _event(self, data: dict[str, Any]) -> None:
        if self.response is None:
            self.response = web.StreamResponse(headers={
                **self.headers, "Content-Type": CONTENT_TYPE, "Cache-Control": "no-cache"})
            await self.response.prepare(self.request)
        await self.response.write(
            b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")

    async def _finish(self) -> web.StreamResponse:
        assert self.response is not None
        await self.response.write_eof()
        return self.response


def joined(texts: list[str]) -> str:
    """Segment texts as one text, the way a transcript joins them."""
    return " ".join(t for t in texts if t)
