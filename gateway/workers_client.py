"""The gateway's client for a session on a realtime worker.

``open_worker_session`` picks a live realtime (or mixed) worker from the Redis
registry, least loaded first (then, because a heartbeat can be a second old, up
to two workers the registry reports full; a full worker refuses at once), and
opens the session as a channel of the gateway's one link to that worker
(``gateway/links.py``, docs/INTERNALS.md). A worker that answers ``overloaded``
(no free slot, or draining) or cannot be reached is skipped and the next one
tried, so a stale registry entry costs one failed connect (at most
``worker_connect_timeout_s``), not a failed session.

Usage (the stream relay in ``gateway/stream.py``; uploads use the same to
transcribe short audio synchronously through the realtime lane)::

    session = await open_worker_session(app, session_id=sid, sample_rate=16000,
                                        language="en")
    try:
        await session.send_audio(pcm)          # any number of times; even length
        await session.end()                    # no more audio
        async for event in session.events():   # partial / final / error / done dicts
            ...                                # ends after "done" or "error"
    finally:
        await session.close()

``events()`` raises ``WorkerLost`` when the worker closes the session without a
``done``/``error``, or when the link to it is lost: the link pings the worker every
few hundred ms and a worker that answers nothing for ``0.75 *
worker_lost_timeout_s`` (``mixed_lost_timeout_s`` for a mixed worker, whose loop
may be busy with a long decode) is declared lost, so a caller learns of a dead
worker within ``worker_lost_timeout_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from engines.base import Task
from gateway.links import Channel, LinkRefused, Lost, silence_limit_s
from gateway.state import LINKS, REDIS, SETTINGS
from lanegate.logs import get_logger
from lanes.registry import WorkerInfo, list_workers, pick_worker
from lanes.routing import Lane

log = get_logger("gateway.workers_client")

__all__ = ["NoWorkers", "Overloaded", "WorkerError", "WorkerLost", "WorkerSession",
           "open_worker_session", "silence_limit_s"]

#: per-session VAD settings sent with ``open`` (None: that setting's worker default)
VadOverrides = dict[str, int | None]
#: workers the registry reports full that are still asked (their record may be stale)
STALE_FULL_TRIES = 2


class WorkerError(Exception):
    """Base of the errors of this module."""


class NoWorkers(WorkerError):
    """No realtime worker is alive (or none could be reached)."""


class Overloaded(WorkerError):
    """Every live realtime worker refused: no free decoder slot anywhere."""


class WorkerLost(WorkerError):
    """The worker closed the session, or its link closed or went silent, before ``done``."""


class WorkerSession:
    """One stream's session on a worker (a channel of its link); see the module docstring."""

    def __init__(self, channel: Channel, *, worker_id: str, lane: str, url: str) -> None:
        self.worker_id = worker_id
        self.lane = lane
        self.url = url
        self._channel = channel
        self._closed = False
        self._finished = False  # events() yielded "done" or "error"

    @property
    def closed(self) -> bool:
        """Closed here, ended by the worker, or its link is lost."""
        return self._closed or self._channel.ended

    async def send_audio(self, pcm: bytes) -> None:
        """Forward PCM s16le mono at the session's rate; ``WorkerLost`` if it is over."""
        if not self.queue_audio(pcm):
            await self._channel.send_audio(pcm)

    def queue_audio(self, pcm: bytes) -> bool:
        """``send_audio`` without waiting: False when the link's batch is full and the
        caller must ``await send_audio`` (the relay's path for every frame)."""
        self._check_open()
        return self._channel.queue_audio(pcm)

    async def end(self) -> None:
        """Tell the worker no more audio comes; it answers its last finals and ``done``."""
        self._check_open()
        self._channel.end()

    async def commit(self) -> None:
        """End the utterance at the audio sent so far; a ``final`` with cut "commit"
        answers it (the OpenAI Realtime API's ``input_audio_buffer.commit``)."""
        self._check_open()
        self._channel.commit()

    def _check_open(self) -> None:
        if self.closed:
            raise WorkerLost(f"the session on worker {self.worker_id} is closed")

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The worker's events as dicts, until (and including) ``done`` or ``error``."""
        while not self._finished:
            event = await self._channel.events.get()
            if isinstance(event, Lost):
                raise WorkerLost(f"worker {self.worker_id}: {event.reason}")
            if event["type"] == "closed":
                raise WorkerLost(f"worker {self.worker_id} closed the session "
                                 f"(code {event.get('code')}) before it was done")
            if event["type"] in ("done", "error"):
                self._finished = True
            yield event

    async def close(self) -> None:
        """Leave the session (an unfinished one is abandoned: the worker frees the slot);
        safe to call twice."""
        self._closed = True
        self._channel.close()


async def _try_worker(
    app: web.Application, worker: WorkerInfo, *, session_id: str, sample_rate: int,
    language: str, vad: VadOverrides | None, prompt: str, temperature: float | None,
    task: Task,
) -> WorkerSession | str:
    """A session on ``worker``, or the reason it refused (``overloaded``/``unreachable``)."""
    try:
        link = await app[LINKS].get(worker)
    except (aiohttp.ClientError, OSError, TimeoutError, LinkRefused) as exc:
        log.warning("worker_unreachable", worker=worker.worker_id, session_id=session_id,
                    error=str(exc) or type(exc).__name__)
        return "unreachable"
    channel = link.open(session_id=session_id, sample_rate=sample_rate, language=language,
                        vad=vad, prompt=prompt, temperature=temperature, task=task)
    try:
        async with asyncio.timeout(app[SETTINGS].worker_connect_timeout_s):
            first = await channel.events.get()
    except TimeoutError:
        first = Lost("no answer to open")
    except BaseException:
        channel.close()
        raise
    if not isinstance(first, Lost) and first["type"] == "accepted":
        return WorkerSession(channel, worker_id=str(first.get("worker") or link.worker_id),
                             lane=str(first.get("lane") or link.lane), url=worker.url)
    channel.close()
    if not isinstance(first, Lost) and first.get("code") == "overloaded":
        return "overloaded"
    log.warning("worker_refused", worker=worker.worker_id, session_id=session_id,
                answer=first)
    return "unreachable"


def _next_worker(workers: list[WorkerInfo], tried: frozenset[str]) -> WorkerInfo | None:
    """The registry's pick; then, since a heartbeat may be a second old, up to
    ``STALE_FULL_TRIES`` workers it reports full (a full worker refuses at once)."""
    worker = pick_worker(workers, tried)
    if worker is not None:
        return worker
    full = sorted((w for w in workers if not w.draining and w.worker_id not in tried),
                  key=lambda w: (w.load, w.step_p99_ms, w.worker_id))
    stale_tries = sum(1 for w in workers if w.worker_id in tried and w.slots_free <= 0)
    if not full or stale_tries >= STALE_FULL_TRIES:
        return None
    return full[0]


async def open_worker_session(
    app: web.Application, *, session_id: str, sample_rate: int, language: str,
    vad: VadOverrides | None = None, exclude: frozenset[str] = frozenset(),
    prompt: str = "", temperature: float | None = None, task: Task = Task.TRANSCRIBE,
) -> WorkerSession:
    """Open a session on the least-loaded live realtime worker with a free slot, other
    than the workers in ``exclude`` (a failover's recently lost ones: the registry lists a dead
    worker until its heartbeat expires).

    ``vad`` overrides the worker's VAD settings for this session (fields in
    ``workers/validation.py``, ``VAD_FIELDS``; ``endpoint_silence_ms: None`` is
    endpointing off). An empty ``language`` is detected by the engine; ``prompt`` and
    ``temperature`` (None: the engine's default) condition its decoder; ``task``
    TRANSLATE asks for English text (Whisper's translate task).

    Raises ``NoWorkers`` when no realtime worker is alive or reachable and
    ``Overloaded`` when every live one is full or refused; both at once, never
    after waiting for a slot. Redis errors propagate (the caller maps them).
    """
    workers = [w for w in await list_workers(app[REDIS], Lane.REALTIME)
               if w.worker_id not in exclude]
    if not workers:
        raise NoWorkers("no realtime worker is alive")
    tried: set[str] = set()
    refusals: list[str] = []
    while (worker := _next_worker(workers, frozenset(tried))) is not None:
        tried.add(worker.worker_id)
        result = await _try_worker(app, worker, session_id=session_id,
                                   sample_rate=sample_rate, language=language, vad=vad,
                                   prompt=prompt, temperature=temperature, task=task)
        if isinstance(result, WorkerSession):
            return result
        refusals.append(result)
    if refusals and all(r == "unreachable" for r in refusals):
        raise NoWorkers("no realtime worker could be reached")
    raise Overloaded("every realtime worker is busy (no free decoder slot)")
