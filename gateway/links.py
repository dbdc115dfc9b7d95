"""The gateway's links: one internal WebSocket per (gateway process, worker), shared
by every session this gateway opens on that worker (protocol in docs/INTERNALS.md).

With hundreds of live streams, a WebSocket message each way per relayed 100 ms
frame and a ping loop per session would make per-message I/O the gateway's CPU.
So on a link all audio queued within ``link_linger_ms`` of the first (2 ms; 0: in
one event-loop tick) leaves in one binary message of ``(channel, length)``-prefixed
records, the worker answers each tick's events
in one text message, and one ping loop covers every session.

``app[LINKS].get(worker)`` returns the worker's ``WorkerLink``, connecting on first
use (concurrent first uses share one attempt). ``link.open(...)`` gives a
``Channel``: the session's number on the link and an Inbox of the worker's events for
it. A link that fails (closed, errored, or silent for ``silence_limit_s``) is lost:
each open channel gets a ``Lost`` marker and the next ``get`` connects afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import WSCloseCode, web

from engines.base import Task
from gateway.state import HTTP, LINKS, SETTINGS
from lanegate import metrics
from lanegate.constants import (
    INTERNAL_TOKEN_HEADER,
    LINK_BATCH_BYTES,
    LINK_PATH,
    LINK_RECORD_HEADER,
)
from lanegate.logs import get_logger
from lanegate.settings import Settings
from lanes.registry import WorkerInfo

log = get_logger("gateway.links")

RECORD = struct.Struct(LINK_RECORD_HEADER)
CHANNEL_MASK = 2**32 - 1
#: fraction of ``worker_lost_timeout_s`` a worker may stay silent, leaving time to tell
#: the client within ``worker_lost_timeout_s`` of the worker's death
SILENCE_FRACTION = 0.75
#: pings per silence limit
PINGS_PER_LIMIT = 5
#: the events that end a channel on the worker's side
FINAL_TYPES = ("done", "error", "closed")


def silence_limit_s(settings: Settings, lane: str) -> float:
    """How long a worker may send nothing (not even a pong) before it is lost."""
    if lane == "mixed":
        return settings.mixed_lost_timeout_s
    return min(settings.worker_lost_timeout_s, settings.link_timeout_s) * SILENCE_FRACTION


class LinkRefused(Exception):
    """The worker answered the link's upgrade with something other than its hello."""


@dataclass(frozen=True)
class Lost:
    """Queue marker: the link carrying this channel is gone."""

    reason: str


class Inbox:
    """A channel's events, read by one task at a time (the session opening, then its
    relay): ``asyncio.Queue``'s ``get``/``put_nowait``/``qsize`` without its bound, its
    task counting and its list of readers, since at hundreds of streams every event
    passes through one. The link bounds it (``max_channel_events``, ``_deliver``)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[dict[str, Any] | Lost] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, item: dict[str, Any] | Lost) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def get_nowait(self) -> dict[str, Any] | Lost:
        """The oldest event; ``IndexError`` when there is none."""
        return self._items.popleft()

    async def get(self) -> dict[str, Any] | Lost:
        while not self._items:
            if self._waiter is not None:
                raise RuntimeError("an Inbox has one reader at a time")
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        return self._items.popleft()


class Channel:
    """One session's end of a link."""

    __slots__ = ("ended", "events", "link", "number")

    def __init__(self, link: WorkerLink, number: int) -> None:
        self.link = link
        self.number = number
        self.events = Inbox()
        self.ended = False  # the worker ended it (done/error/closed) or the link is lost

    def queue_audio(self, pcm: bytes) -> bool:
        """Queue ``pcm`` unless the link's batch is full (False: ``send_audio`` waits)."""
        return self.link.queue_audio(self.number, pcm)

    async def send_audio(self, pcm: bytes) -> None:
        await self.link.send_audio(self.number, pcm)

    def end(self) -> None:
        self.link.send_op({"op": "end", "ch": self.number})

    def commit(self) -> None:
        self.link.send_op({"op": "commit", "ch": self.number})

    def close(self) -> None:
        """Forget the channel; a channel the worker still serves is abandoned."""
        if self.link.channels.pop(self.number, None) is not None:
            self.link.send_op({"op": "abandon", "ch": self.number})
        self.ended = True


class WorkerLink:
    """The link to one worker: a sender, a reader and a watch loop that pings and
    notices silence (module docstring)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, *, url: str, worker_id: str,
                 lane: str, silence_s: float,
                 on_lost: Callable[[WorkerLink], None], max_events: int = 1000,
                 linger_s: float = 0.0) -> None:
        self.url = url
        self.linger_s = linger_s
        self.max_events = max(1, max_events)
        self.worker_id = worker_id
        self.lane = lane
        self.channels: dict[int, Channel] = {}
        self.lost: str | None = None  # why, once lost
        self._ws = ws
        self._silence_s = silence_s
        self._heard = asyncio.get_running_loop().time()  # when the worker last sent anything
        self._on_lost = on_lost
        self._next_number = 0
        # control ops, and between them the audio records that go out as one message
        # (a message's audio records as parts, joined when it is sent: one copy)
        self._pending: deque[list[bytes] | str] = deque()
        self._pending_audio = 0  # bytes of audio records in _pending
        self._tail_bytes = 0  # bytes in _pending[-1], while that is audio
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()  # set ``linger_s`` after the first of a message's items
        self._armed = False  # the wake is set or due: the sender takes what is queued
        self._room = asyncio.Event()  # set while _pending_audio is under LINK_BATCH_BYTES
        self._room.set()
        self._tasks = [asyncio.create_task(loop(), name=f"link-{name}-{worker_id}")
                       for name, loop in (("send", self._send_loop), ("read", self._read_loop),
                                          ("watch", self._watch_loop))]
        metrics.GATEWAY_WORKER_LINKS.labels(lane=lane).inc()

    # --- channels ------------------------------------------------------------------
    def open(self, *, session_id: str, sample_rate: int, language: str,
             vad: dict[str, int | None] | None = None, prompt: str = "",
             temperature: float | None = None, task: Task = Task.TRANSCRIBE) -> Channel:
        """A new channel; the worker's answer (``accepted`` or ``error``) is its first event.
        An empty ``language`` asks the engine to detect it; ``prompt``, ``temperature``
        and ``task`` go out only when given (``task`` when not the default)."""
        channel = Channel(self, self._new_number())
        if self.lost is not None:
            channel.ended = True
            channel.events.put_nowait(Lost(self.lost))
            return channel
        self.channels[channel.number] = channel
        op: dict[str, Any] = {"op": "open", "ch": channel.number, "session_id": session_id,
                              "sample_rate": sample_rate, "language": language}
        if vad is not None:
            op["vad"] = vad
        if prompt:
            op["prompt"] = prompt
        if temperature is not None:
            op["temperature"] = temperature
        if task is not Task.TRANSCRIBE:
            op["task"] = task.value
        self.send_op(op)
        return channel

    def _new_number(self) -> int:
        while True:
            number = self._next_number
            self._next_number = (number + 1) & CHANNEL_MASK
            if number not in self.channels:
                return number

    # --- gateway -> worker -----------------------------------------------------------
    async def send_audio(self, number: int, pcm: bytes) -> None:
        """Queue one audio record; waits while a full batch is still unsent."""
        while not self.queue_audio(number, pcm):
            self._room.clear()
            await self._room.wait()

    def queue_audio(self, number: int, pcm: bytes) -> bool:
        """Queue one audio record unless a full batch is still unsent (False). A lost
        link takes nothing (True): the channel has its Lost marker."""
        if self.lost is not None:
            return True
        if self._pending_audio >= LINK_BATCH_BYTES:
            return False
        pending = self._pending
        records = pending[-1] if pending else None
        if not isinstance(records, list) or self._tail_bytes >= LINK_BATCH_BYTES:
            records = []
            pending.append(records)
            self._tail_bytes = 0
        records.append(RECORD.pack(number, len(pcm)))
        records.append(pcm)  # copied once, when the message is joined
        size = RECORD.size + len(pcm)
        self._tail_bytes += size
        self._pending_audio += size
        if not self._armed:
            self._arm()
        return True

    def send_op(self, op: dict[str, Any]) -> None:
        if self.lost is None:
            self._pending.append(json.dumps(op, separators=(",", ":")))
            if not self._armed:
                self._arm()

    def _arm(self) -> None:
        """Wake the sender ``linger_s`` from now (let more streams' frames join this
        message), or in this tick: one timer per message, not a sleep per wake."""
        self._armed = True
        if self.linger_s:
            self._loop.call_later(self.linger_s, self._wake.set)
        else:
            self._wake.set()

    async def _send_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                self._armed = False  # what is queued from now on arms the next message
                while self._pending:
                    message = self._next_message()
                    if isinstance(message, str):
                        await self._ws.send_str(message)
                    else:
                        await self._ws.send_bytes(message)
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            await self._fail(f"sending failed: {exc or type(exc).__name__}")

    def _next_message(self) -> bytes | str:
        """The next op, or the audio records up to the next op (about LINK_BATCH_BYTES)."""
        message = self._pending.popleft()
        if isinstance(message, str):
            return message
        data = b"".join(message)
        self._pending_audio -= len(data)
        if self._pending_audio < LINK_BATCH_BYTES:
            self._room.set()
        return data

    async def _watch_loop(self) -> None:
        """Ping the worker, and lose the link once it has sent nothing (not even a pong)
        for ``silence_s``. One timer per link: a timeout around each read would arm and
        cancel one per message."""
        loop = asyncio.get_running_loop()
        every = self._silence_s / PINGS_PER_LIMIT
        ping_at = loop.time() + every
        while True:
            now = loop.time()
            silent_at = self._heard + self._silence_s
            if now >= silent_at:
                return await self._fail(f"silent for {self._silence_s:.1f} s")
            if now >= ping_at:
                ping_at = now + every
                with contextlib.suppress(ConnectionError, aiohttp.ClientError, RuntimeError):
                    await self._ws.ping()
            await asyncio.sleep(min(ping_at, silent_at) - now)

    # --- worker -> gateway -----------------------------------------------------------
    async def _read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            msg = await self._ws.receive()
            self._heard = loop.time()
            if msg.type is aiohttp.WSMsgType.TEXT:
                self._deliver(msg.data)
            elif msg.type is aiohttp.WSMsgType.PING:
                with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                    await self._ws.pong(msg.data)
            elif msg.type is aiohttp.WSMsgType.BINARY:
                log.warning("worker_unexpected_binary", worker=self.worker_id)
            elif msg.type is not aiohttp.WSMsgType.PONG:  # CLOSE / CLOSED / ERROR
                code = self._ws.close_code
                if code == WSCloseCode.GOING_AWAY:
                    return await self._fail("the worker is stopping", expected=True)
                return await self._fail(f"closed the link (code {code})")

    def _deliver(self, data: str) -> None:
        """Hand each ``[ch, event]`` of one batch to its channel."""
        for number, event in _parse_batch(data, self.worker_id):
            channel = self.channels.get(number)
            if channel is None:
                continue  # closed here; the worker had not heard yet
            if channel.events.qsize() >= self.max_events:
                self._overrun(channel)
                continue
            if event["type"] in FINAL_TYPES:
                channel.ended = True
                del self.channels[number]
            channel.events.put_nowait(event)

    def _overrun(self, channel: Channel) -> None:
        """The session's reader fell ``max_events`` behind: end it, not the link."""
        log.warning("channel_overrun", worker=self.worker_id, channel=channel.number,
                    events=channel.events.qsize())
        channel.close()  # abandoned at the worker, its slot freed
        channel.events.put_nowait({
            "type": "error", "code": "overloaded",
            "message": f"the client read its events too slowly ({self.max_events} waiting, "
                       "max_channel_events)"})

    # --- losing and closing -----------------------------------------------------------
    def _lose(self, reason: str, *, expected: bool = False) -> None:
        """``expected``: a shutdown (this gateway's or the worker's); with no session
        open on the link nothing is lost, and a normal Ctrl-C logs no warning."""
        if self.lost is not None:
            return
        self.lost = reason
        quiet = expected and not self.channels
        (log.info if quiet else log.warning)(
            "worker_link_closed" if quiet else "worker_link_lost", worker=self.worker_id,
            url=self.url, reason=reason, channels=len(self.channels))
        for channel in self.channels.values():
            channel.ended = True
            channel.events.put_nowait(Lost(reason))
        self.channels.clear()
        self._pending.clear()
        self._room.set()
        metrics.GATEWAY_WORKER_LINKS.labels(lane=self.lane).dec()
        self._on_lost(self)
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    async def _fail(self, reason: str, *, expected: bool = False) -> None:
        self._lose(reason, expected=expected)
        with contextlib.suppress(ConnectionError, aiohttp.ClientError, TimeoutError):
            await self._ws.close()

    async def close(self) -> None:
        """Gateway shutdown: stop the link's tasks and close its WebSocket."""
        self._lose("the gateway is shutting down", expected=True)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(ConnectionError, aiohttp.ClientError, TimeoutError):
            await self._ws.close()


async def _hello(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any] | None:
    """The worker's first message, ``{"type":"link",...}``, or None."""
    msg = await ws.receive()
    if msg.type is not aiohttp.WSMsgType.TEXT:
        return None
    with contextlib.suppress(ValueError):
        hello = json.loads(msg.data)
        if isinstance(hello, dict) and hello.get("type") == "link":
            return hello
    return None


def _parse_batch(data: str, worker_id: str) -> list[tuple[int, dict[str, Any]]]:
    try:
        pairs = json.loads(data)
    except ValueError:
        pairs = None
    if not isinstance(pairs, list):
        log.warning("worker_bad_batch", worker=worker_id)
        return []
    out = []
    for pair in pairs:
        if (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], int)
                and isinstance(pair[1], dict) and isinstance(pair[1].get("type"), str)):
            out.append((pair[0], pair[1]))
        else:
            log.warning("worker_bad_event", worker=worker_id)
    return out


class WorkerLinks:
    """The gateway's links by worker URL, each connected on first use."""

    def __init__(self, http: aiohttp.ClientSession, settings: Settings) -> None:
        self._http = http
        self._settings = settings
        self._links: dict[str, asyncio.Task[WorkerLink]] = {}

    async def get(self, worker: WorkerInfo) -> WorkerLink:
        """The link to ``worker``; raises what connecting raised (aiohttp errors,
        ``OSError``, ``TimeoutError``, ``LinkRefused``)."""
        task = self._links.get(worker.url)
        if task is None:
            task = asyncio.create_task(self._connect(worker), name=f"link-{worker.worker_id}")
            self._links[worker.url] = task
            task.add_done_callback(lambda t: self._forget_failed(worker.url, t))
        return await asyncio.shield(task)

    def _forget_failed(self, url: str, task: asyncio.Task[WorkerLink]) -> None:
        if (task.cancelled() or task.exception() is not None) and self._links.get(url) is task:
            del self._links[url]

    def _forget(self, link: WorkerLink) -> None:
        task = self._links.get(link.url)
        if task is not None and task.done() and not task.cancelled() \
                and task.exception() is None and task.result() is link:
            del self._links[link.url]

    async def _connect(self, worker: WorkerInfo) -> WorkerLink:
        timeout = self._settings.worker_connect_timeout_s
        url = worker.url.rstrip("/") + LINK_PATH
        token = self._settings.internal_token
        headers = {INTERNAL_TOKEN_HEADER: token} if token else {}
        # one bound on connect + hello: a frozen worker never answers the upgrade
        async with asyncio.timeout(timeout):
            ws = await self._http.ws_connect(
                url, autoping=False, max_msg_size=0, headers=headers,
                timeout=aiohttp.ClientWSTimeout(ws_close=timeout))
            try:
                hello = await _hello(ws)
            except BaseException:
                await ws.close()
                raise
        if hello is None:
            raise LinkRefused(f"worker {worker.worker_id} did not say hello")
        lane = str(hello.get("lane") or worker.lane)
        log.info("worker_link_open", worker=worker.worker_id, url=worker.url, lane=lane)
        return WorkerLink(ws, url=worker.url, worker_id=str(hello.get("worker") or
                                                               worker.worker_id),
                          lane=lane, silence_s=silence_limit_s(self._settings, lane),
                          on_lost=self._forget, max_events=self._settings.max_channel_events,
                          linger_s=self._settings.link_linger_ms / 1000)

    async def close(self) -> None:
        tasks = list(self._links.values())
        self._links.clear()
        for task in tasks:
            task.cancel()  # a connect still under way; a done task ignores it
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is None:
                await task.result().close()


async def links_ctx(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: the links open with the app and close before its client session."""
    links = WorkerLinks(app[HTTP], app[SETTINGS])
    app[LINKS] = links
    yield
    await links.close()

