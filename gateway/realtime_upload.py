"""A short upload transcribed right away on the realtime lane.

The decoded PCM is sent to a realtime worker over the same internal session a
live stream uses, in ``FRAME_MS`` frames as fast as the socket takes them;
the worker's scheduler digests it in capped chunks (capped chunked prefill),
so the upload never stalls the live sessions on that worker. The finals that
come back become a :class:`~lanegate.transcript.Transcript`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from engines.base import Task
from gateway.auth import lease_member
from gateway.state import LEASES, UPLOAD_POOL
from gateway.workers_client import (
    NoWorkers,
    Overloaded,
    WorkerLost,
    WorkerSession,
    open_worker_session,
)
from lanegate.constants import ENGINE_SAMPLE_RATE, SAMPLE_WIDTH
from lanegate.transcript import Segment, Transcript, Word

#: audio per binary frame sent to the worker (the worker caps each step anyway)
FRAME_MS = 1000
FRAME_BYTES = ENGINE_SAMPLE_RATE * SAMPLE_WIDTH * FRAME_MS // 1000

#: told of each segment as its final arrives (a streamed transcription sends it on)
OnSegment = Callable[[Segment], Awaitable[None]]


class RealtimeUnavailable(Exception):
    """The realtime lane cannot take the upload (no worker, no free slot, worker lost)."""


class RealtimeFailed(Exception):
    """The worker reported an error for the session."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


async def transcribe_realtime(app: web.Application, pcm: Path, *, session_id: str,
                              subject: str, language: str, duration: float,
                              timeout_s: float, on_segment: OnSegment | None = None,
                              prompt: str = "", temperature: float | None = None,
                              task: Task = Task.TRANSCRIBE) -> Transcript:
    """Transcribe ``pcm`` (16 kHz s16le mono) on a realtime worker.

    Raises :class:`RealtimeUnavailable` when ``subject`` (the API key, or the client
    address with auth off) holds its maximum of sessions (see :func:`admit`), no
    worker takes the session or the worker is lost before the end;
    :class:`RealtimeFailed` for a worker error; ``TimeoutError`` after ``timeout_s``.
    The transcript's language is ``language`` when one was asked for, else the one the
    finals report most (the engine's detection), as a batch job's is.
    """
    await admit(app, subject, session_id)
    try:
        decoding = Decoding(language, prompt, temperature, task)
        segments, languages = await _transcribe(app, pcm, session_id=session_id,
                                                decoding=decoding, timeout_s=timeout_s,
                                                on_segment=on_segment)
    finally:
        with contextlib.suppress(RedisError):  # the lease expires by itself
            await app[LEASES].release(subject, lease_member(app, session_id))
    return Transcript.from_segments(segments, duration=duration,
                                    language=reported_language(language, languages))


def reported_language(asked: str, detected: list[str]) -> str:
    """The language asked for, else the one the finals report most."""
    found = [lang for lang in detected if lang]
    if asked or not found:
        return asked
    return max(dict.fromkeys(found), key=found.count)


async def admit(app: web.Application, subject: str, session_id: str) -> None:
    """Count the upload as one of ``subject``'s concurrent realtime sessions, like a
    stream (``gateway.auth.session_limit``), or raise RealtimeUnavailable. (Whether the
    lane has a slot to spare is ``lanes.routing.route_upload``'s decision.)"""
    if await app[LEASES].admit(subject, lease_member(app, session_id)) is not None:
        raise RealtimeUnavailable("the API key holds its maximum of realtime sessions")


@dataclass(frozen=True)
class Decoding:
    """What the session asks of the decoder."""

    language: str
    prompt: str
    temperature: float | None
    task: Task


async def _transcribe(app: web.Application, pcm: Path, *, session_id: str, decoding: Decoding,
                      timeout_s: float, on_segment: OnSegment | None
                      ) -> tuple[list[Segment], list[str]]:
    try:
        session = await open_worker_session(
            app, session_id=session_id, sample_rate=ENGINE_SAMPLE_RATE,
            language=decoding.language, prompt=decoding.prompt,
            temperature=decoding.temperature, task=decoding.task)
    except (Overloaded, NoWorkers) as exc:
        raise RealtimeUnavailable(str(exc) or type(exc).__name__) from exc
    try:
        async with asyncio.timeout(timeout_s):
            return await _run(session, pcm, app[UPLOAD_POOL], on_segment)
    except WorkerLost as exc:
        raise RealtimeUnavailable(str(exc)) from exc
    finally:
        with contextlib.suppress(Exception):
            await session.close()


async def _run(session: WorkerSession, pcm: Path, pool: Executor,
               on_segment: OnSegment | None) -> tuple[list[Segment], list[str]]:
    """Send and collect at once; the collector's outcome wins (a worker ``error`` event
    explains a send that failed because the worker closed the session)."""
    sender = asyncio.create_task(_send(session, pcm, pool))
    collector = asyncio.create_task(_collect(session, on_segment))
    try:
        await asyncio.wait({sender, collector}, return_when=asyncio.FIRST_EXCEPTION)
        if sender.done() and not collector.done():
            error = sender.exception()
            if error is not None and not isinstance(error, WorkerLost):
                raise error
        return await collector
    finally:
        for task in (sender, collector):
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _send(session: WorkerSession, pcm: Path, pool: Executor) -> None:
    loop = asyncio.get_running_loop()
    handle = await loop.run_in_executor(pool, open, pcm, "rb")
    try:
        while chunk := await loop.run_in_executor(pool, handle.read, FRAME_BYTES):
            await session.send_audio(chunk)
    finally:
        await loop.run_in_executor(pool, handle.close)
    await session.end()


async def _collect(session: WorkerSession, on_segment: OnSegment | None
                   ) -> tuple[list[Segment], list[str]]:
    """The finals' segments, and the language each reports ("" where none)."""
    segments: list[Segment] = []
    languages: list[str] = []
    async for event in session.events():
        kind = event.get("type")
        if kind == "final":
            segments.append(segment_of(event))
            languages.append(str(event.get("language") or ""))
            if on_segment is not None:
                await on_segment(segments[-1])
        elif kind == "error":
            code = str(event.get("code", "internal"))
            message = str(event.get("message", ""))
            if code == "worker_lost":
                raise RealtimeUnavailable(message or "the realtime worker was lost")
            raise RealtimeFailed(code, message)
        elif kind == "done":
            return segments, languages
    raise RealtimeUnavailable("the realtime worker closed the session before `done`")


def segment_of(event: dict[str, Any]) -> Segment:
    """A ``final`` event as a transcript segment (event times are ms from session start)."""
    start = float(event.get("start_ms", 0)) / 1000.0
    end = float(event.get("end_ms", 0)) / 1000.0
    words = tuple(
        Word(word=str(w["word"]), start=float(w["start"]), end=float(w["end"]))
        for w in event.get("words", ()) or ()
    )
    return Segment(start=start, end=end, text=str(event.get("text", "")).strip(),
                   words=words, cut=str(event.get("cut", "endpoint")))
