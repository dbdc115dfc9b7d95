"""The gateway's client for a realtime worker's internal WebSocket session.

``open_worker_session`` picks a live realtime (or mixed) worker from the Redis
registry, least loaded first (then, because a heartbeat can be a second old, up
to two workers the registry reports full; a full worker refuses at once), and opens
``{worker.url}/internal/v1/session?session_id=S&sample_rate=R&language=L``
(docs/INTERNALS.md). A worker that answers ``overloaded`` (no free slot, or
draining) or cannot be reached is skipped and the next one tried, so a stale
registry entry costs one failed connect (at most ``worker_connect_timeout_s``),
not a failed session.

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

``events()`` raises ``WorkerLost`` when the connection closes without a
``done``/``error``, or when the worker goes silent: the session pings the
worker every few hundred ms and a worker that answers nothing for
``0.75 * worker_lost_timeout_s`` (``mixed_lost_timeout_s`` for a mixed worker,
whose loop may be busy with a long decode) is declared lost, so a caller learns
of a dead worker within ``worker_lost_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from gateway.state import HTTP, REDIS, SETTINGS
from lanegate.logs import get_logger
from lanegate.settings import Settings
from workers.registry import WorkerInfo, list_workers, pick_worker

log = get_logger("gateway.workers_client")

SESSION_PATH = "/internal/v1/session"
#: fraction of ``worker_lost_timeout_s`` a worker may stay silent, leaving time to tell
#: the client within ``worker_lost_timeout_s`` of the worker's death
SILENCE_FRACTION = 0.75
#: pings per silence limit
PINGS_PER_LIMIT = 5
#: workers the registry reports full that are still asked (their record may be stale)
STALE_FULL_TRIES = 2


class WorkerError(Exception):
    """Base of the errors of this module."""


class NoWorkers(WorkerError):
    """No realtime worker is alive (or none could be reached)."""


class Overloaded(WorkerError):
    """Every live realtime worker refused: no free decoder slot anywhere."""


class WorkerLost(WorkerError):
    """The worker's connection closed or went silent before ``done``."""


def silence_limit_s(settings: Settings, lane: str) -> float:
    """How long a worker may send nothing (not even a pong) before it is lost."""
    if lane == "mixed":
        return settings.mixed_lost_timeout_s
    return settings.worker_lost_timeout_s * SILENCE_FRACTION


class WorkerSession:
    """One stream's connection to a worker; see the module docstring."""

    def __init__(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        *,
        worker_id: str,
        lane: str,
        url: str,
        silence_s: float,
    ) -> None:
        self.worker_id = worker_id
        self.lane = lane
        self.url = url
        self._ws = ws
        self._silence_s = silence_s
        self._finished = False  # saw "done" or "error"
        self._pinger = asyncio.create_task(self._ping_loop(), name=f"ping-{worker_id}")

    @property
    def closed(self) -> bool:
        return self._ws.closed

    async def send_audio(self, pcm: bytes) -> None:
        """Forward PCM s16le mono at the session's rate; ``WorkerLost`` if the link is down."""
        self._check_open()
        try:
            await self._ws.send_bytes(pcm)
        except (ConnectionError, aiohttp.ClientError) as exc:
            raise WorkerLost(f"worker {self.worker_id}: {exc}") from exc

    async def end(self) -> None:
        """Tell the worker no more audio comes; it answers its last finals and ``done``."""
        self._check_open()
        try:
            await self._ws.send_str('{"type":"end"}')
        except (ConnectionError, aiohttp.ClientError) as exc:
            raise WorkerLost(f"worker {self.worker_id}: {exc}") from exc

    def _check_open(self) -> None:
        if self._ws.closed:
            raise WorkerLost(f"connection to worker {self.worker_id} is closed")

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The worker's events as dicts, until (and including) ``done`` or ``error``."""
        while not self._finished:
            try:
                msg = await self._ws.receive(timeout=self._silence_s)
            except TimeoutError as exc:
                raise WorkerLost(
                    f"worker {self.worker_id} silent for {self._silence_s:.1f} s"
                ) from exc
            if msg.type is aiohttp.WSMsgType.TEXT:
                event = _parse_event(msg.data)
                if event is None:
                    log.warning("worker_bad_event", worker=self.worker_id)
                    continue
                if event["type"] in ("done", "error"):
                    self._finished = True
                yield event
            elif msg.type is aiohttp.WSMsgType.PING:
                with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                    await self._ws.pong(msg.data)
            elif msg.type is aiohttp.WSMsgType.PONG:
                continue
            elif msg.type is aiohttp.WSMsgType.BINARY:
                log.warning("worker_unexpected_binary", worker=self.worker_id)
            else:  # CLOSE / CLOSING / CLOSED / ERROR
                raise WorkerLost(
                    f"worker {self.worker_id} closed the session "
                    f"(code {self._ws.close_code}) before it was done"
                )

    async def _ping_loop(self) -> None:
        interval = self._silence_s / PINGS_PER_LIMIT
        with contextlib.suppress(ConnectionError, aiohttp.ClientError, RuntimeError):
            while not self._ws.closed:
                await asyncio.sleep(interval)
                if not self._ws.closed:
                    await self._ws.ping()

    async def close(self) -> None:
        """Close the connection (the worker frees the slot); safe to call twice."""
        self._pinger.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._pinger
        if not self._ws.closed:
            with contextlib.suppress(ConnectionError, aiohttp.ClientError, TimeoutError):
                await self._ws.close()


def _parse_event(data: str) -> dict[str, Any] | None:
    try:
        event = json.loads(data)
    except ValueError:
        return None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        return None
    return event


def session_url(worker: WorkerInfo, *, session_id: str, sample_rate: int, language: str) -> str:
    return str(
        URL(worker.url.rstrip("/") + SESSION_PATH).with_query(
            session_id=session_id, sample_rate=str(sample_rate), language=language
        )
    )


async def _try_worker(
    app: web.Application, worker: WorkerInfo, *, session_id: str, sample_rate: int,
    language: str,
) -> WorkerSession | str:
    """A session on ``worker``, or the reason it refused (``overloaded``/``unreachable``)."""
    settings = app[SETTINGS]
    url = session_url(worker, session_id=session_id, sample_rate=sample_rate, language=language)
    timeout = settings.worker_connect_timeout_s
    try:
        async with asyncio.timeout(timeout):  # a frozen worker never answers the upgrade
            ws = await app[HTTP].ws_connect(
                url, autoping=False, timeout=aiohttp.ClientWSTimeout(ws_close=timeout),
            )
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        log.warning("worker_unreachable", worker=worker.worker_id, session_id=session_id,
                    error=str(exc) or type(exc).__name__)
        return "unreachable"
    try:
        async with asyncio.timeout(timeout):
            first = await _first_event(ws)
    except (TimeoutError, aiohttp.ClientError, ConnectionError):
        first = None
    if first is not None and first.get("type") == "accepted":
        lane = str(first.get("lane") or worker.lane)
        return WorkerSession(ws, worker_id=str(first.get("worker") or worker.worker_id),
                             lane=lane, url=worker.url,
                             silence_s=silence_limit_s(settings, lane))
    with contextlib.suppress(ConnectionError, aiohttp.ClientError, TimeoutError):
        await ws.close()
    if first is not None and first.get("code") == "overloaded":
        return "overloaded"
    log.warning("worker_refused", worker=worker.worker_id, session_id=session_id,
                answer=first)
    return "unreachable"


async def _first_event(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any] | None:
    """The worker's first text message (``accepted`` or an ``error``), or None."""
    while True:
        msg = await ws.receive()
        if msg.type is aiohttp.WSMsgType.TEXT:
            return _parse_event(msg.data)
        if msg.type is aiohttp.WSMsgType.PING:
            await ws.pong(msg.data)
        elif msg.type is not aiohttp.WSMsgType.PONG:
            return None


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
    app: web.Application, *, session_id: str, sample_rate: int, language: str
) -> WorkerSession:
    """Open a session on the least-loaded live realtime worker with a free slot.

    Raises ``NoWorkers`` when no realtime worker is alive or reachable and
    ``Overloaded`` when every live one is full or refused; both at once, never
    after waiting for a slot. Redis errors propagate (the caller maps them).
    """
    workers = await list_workers(app[REDIS], "realtime")
    if not workers:
        raise NoWorkers("no realtime worker is alive")
    tried: set[str] = set()
    refusals: list[str] = []
    while (worker := _next_worker(workers, frozenset(tried))) is not None:
        tried.add(worker.worker_id)
        result = await _try_worker(app, worker, session_id=session_id,
                                   sample_rate=sample_rate, language=language)
        if isinstance(result, WorkerSession):
            return result
        refusals.append(result)
    if refusals and all(r == "unreachable" for r in refusals):
        raise NoWorkers("no realtime worker could be reached")
    raise Overloaded("every realtime worker is busy (no free decoder slot)")
