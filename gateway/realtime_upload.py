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
from pathlib import Path
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from gateway.auth import acquire_session, release_session
from gateway.state import REDIS, SETTINGS
from gateway.workers_client import (
    NoWorkers,
    Overloaded,
    WorkerLost,
    WorkerSession,
    open_worker_session,
)
from lanegate.constants import ENGINE_SAMPLE_RATE, SAMPLE_WIDTH
from lanegate.transcript import Segment, Transcript, Word
from lanes.routing import realtime_admits
from workers.registry import list_workers

#: audio per binary frame sent to the worker (the worker caps each step anyway)
FRAME_MS = 1000
FRAME_BYTES = ENGINE_SAMPLE_RATE * SAMPLE_WIDTH * FRAME_MS // 1000


class RealtimeUnavailable(Exception):
    """The realtime lane cannot take the upload (no worker, no free slot, worker lost)."""


class RealtimeFailed(Exception):
    """The worker reported an error for the session."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


async def transcribe_realtime(app: web.Application, pcm: Path, *, session_id: str,
                              tenant: str, language: str, duration: float,
                              timeout_s: float) -> Transcript:
    """Transcribe ``pcm`` (16 kHz s16le mono) on a realtime worker.

    Raises :class:`RealtimeUnavailable` when the lane has no slot to spare (see
    :func:`admit`), no worker takes the session or the worker is lost before the
    end; :class:`RealtimeFailed` for a worker error; ``TimeoutError`` after
    ``timeout_s``.
    """
    await admit(app, tenant, session_id)
    try:
        segments = await _transcribe(app, pcm, session_id=session_id, language=language,
                                     timeout_s=timeout_s)
    finally:
        with contextlib.suppress(RedisError):  # the lease expires by itself
            await release_session(app[REDIS], app[SETTINGS], tenant, session_id)
    return Transcript.from_segments(segments, duration=duration, language=language)


async def admit(app: web.Application, tenant: str, session_id: str) -> None:
    """Take a place on the realtime lane for an upload, or raise RealtimeUnavailable.

    The lane must have more free slots than ``upload_reserve_slots`` (from the
    registry, up to one heartbeat old), and the upload counts as one of the API
    key's ``max_sessions_per_key`` concurrent realtime sessions, like a stream.
    """
    redis, settings = app[REDIS], app[SETTINGS]
    free = sum(w.slots_free for w in await list_workers(redis, "realtime") if not w.draining)
    if not realtime_admits(free, settings):
        raise RealtimeUnavailable(
            f"{free} free realtime slots; {settings.upload_reserve_slots} are kept for "
            "live streams")
    if not await acquire_session(redis, settings, tenant, session_id):
        raise RealtimeUnavailable("the API key holds its maximum of realtime sessions")


async def _transcribe(app: web.Application, pcm: Path, *, session_id: str, language: str,
                      timeout_s: float) -> list[Segment]:
    try:
        session = await open_worker_session(
            app, session_id=session_id, sample_rate=ENGINE_SAMPLE_RATE, language=language)
    except (Overloaded, NoWorkers) as exc:
        raise RealtimeUnavailable(str(exc) or type(exc).__name__) from exc
    try:
        async with asyncio.timeout(timeout_s):
            return await _run(session, pcm)
    except WorkerLost as exc:
        raise RealtimeUnavailable(str(exc)) from exc
    finally:
        with contextlib.suppress(Exception):
            await session.close()


async def _run(session: WorkerSession, pcm: Path) -> list[Segment]:
    """Send and collect at once; the collector's outcome wins (a worker ``error`` event
    explains a send that failed because the worker closed the session)."""
    sender = asyncio.create_task(_send(session, pcm))
    collector = asyncio.create_task(_collect(session))
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


async def _send(session: WorkerSession, pcm: Path) -> None:
    handle = await asyncio.to_thread(open, pcm, "rb")
    try:
        while chunk := await asyncio.to_thread(handle.read, FRAME_BYTES):
            await session.send_audio(chunk)
    finally:
        await asyncio.to_thread(handle.close)
    await session.end()


async def _collect(session: WorkerSession) -> list[Segment]:
    segments: list[Segment] = []
    async for event in session.events():
        kind = event.get("type")
        if kind == "final":
            segments.append(segment_of(event))
        elif kind == "error":
            code = str(event.get("code", "internal"))
            message = str(event.get("message", ""))
            if code == "worker_lost":
                raise RealtimeUnavailable(message or "the realtime worker was lost")
            raise RealtimeFailed(code, message)
        elif kind == "done":
            return segments
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
