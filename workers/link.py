"""``GET /internal/v1/link``: all of one gateway's sessions on this worker over one
WebSocket (protocol in docs/INTERNALS.md).

Each session is a numbered channel. Audio for many channels arrives in one binary
message of ``(channel, length)``-prefixed records; every event the step loop posts
for any channel of the link within one event-loop tick leaves in one text message,
a JSON array of ``[channel, event]`` pairs. Per message, not per frame, is where a
gateway relaying hundreds of live streams spends its CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import WSMsgType, web

from lanegate.constants import CLOSE_POLICY, LINK_BATCH_BYTES, LINK_RECORD_HEADER
from lanegate.logs import get_logger
from lanegate.settings import Settings
from lanes.session import Event
from lanes.steploop import Close, SessionHandle
from workers.validation import Refused, session_params

if TYPE_CHECKING:
    from workers.realtime import RealtimeWorker

RECORD = struct.Struct(LINK_RECORD_HEADER)
MAX_CHANNEL = 2**32 - 1

log = get_logger("lanegate.worker.link")


def heartbeat_s(settings: Settings) -> float:
    """aiohttp's ``heartbeat=`` for the worker's sockets: after this long with nothing
    received it pings, and closes the socket if no pong comes within half of that. So a
    silent gateway is dropped 0.75 x ``link_timeout_s`` after its last message (plus up
    to 1 s where aiohttp rounds a timer over 5 s up to a whole second): within
    ``link_timeout_s`` from 4 s up. A live gateway pings every few hundred ms."""
    return settings.link_timeout_s / 2


class ProtocolViolation(ValueError):
    """The gateway sent something no correct gateway sends: the link is closed 1008."""


def audio_records(data: bytes) -> list[tuple[int, bytes]]:
    """The ``(channel, pcm)`` records of one binary message, in order."""
    records = []
    offset = 0
    while offset < len(data):
        if offset + RECORD.size > len(data):
            raise ProtocolViolation(f"truncated record header at byte {offset}")
        channel, length = RECORD.unpack_from(data, offset)
        offset += RECORD.size
        if offset + length > len(data):
            raise ProtocolViolation(f"record of channel {channel} runs past the message")
        records.append((channel, data[offset:offset + length]))
        offset += length
    return records


def control_op(data: str) -> tuple[str, int, dict[str, Any]]:
    """``(op, channel, the whole op)`` of one text message."""
    try:
        op = json.loads(data)
    except RecursionError:
        raise ProtocolViolation("a control op nests too deep") from None
    except ValueError:
        raise ProtocolViolation("text messages must be JSON") from None
    if not isinstance(op, dict):
        raise ProtocolViolation("a control op is a JSON object")
    channel = op.get("ch")
    if isinstance(channel, bool) or not isinstance(channel, int) \
            or not 0 <= channel <= MAX_CHANNEL:
        raise ProtocolViolation(f"ch must be a uint32, got {channel!r}")
    if op.get("op") not in ("open", "end", "commit", "abandon"):
        raise ProtocolViolation(f"unknown op {op.get('op')!r}")
    return op["op"], channel, op


class Link:
    """One gateway's link: its open channels and the events waiting to go out."""

    def __init__(self, worker: RealtimeWorker, ws: web.WebSocketResponse) -> None:
        self.worker = worker
        self.ws = ws
        self.channels: dict[int, SessionHandle] = {}
        self._outgoing: list[tuple[int, Event]] = []
        self._slots_changed = False
        self._wake = asyncio.Event()

    # --- gateway -> worker ---------------------------------------------------------
    async def receive(self) -> None:
        """Serve the gateway's messages until it goes or breaks the protocol."""
        async for msg in self.ws:
            try:
                if msg.type == WSMsgType.BINARY:
                    for channel, pcm in audio_records(msg.data):
                        self._audio(channel, pcm)
                elif msg.type == WSMsgType.TEXT:
                    self._control(*control_op(msg.data))
                else:
                    return
            except ProtocolViolation as exc:
                log.warning("link_violation", worker=self.worker.worker_id, error=str(exc))
                await self.ws.close(code=CLOSE_POLICY, message=str(exc)[:120].encode())
                return

    def _control(self, op: str, channel: int, fields: dict[str, Any]) -> None:
        if op == "open":
            self._open(channel, fields)
        elif op == "end":
            self._end(channel)
        elif op == "commit":
            self._commit(channel)
        else:
            self._abandon(channel)

    def _open(self, channel: int, fields: dict[str, Any]) -> None:
        if channel in self.channels:
            raise ProtocolViolation(f"channel {channel} is already open")
        session_id = fields.get("session_id")
        try:
            session_id, rate = session_params(session_id, fields.get("sample_rate"))
            handle = self.worker.open_session(session_id, rate, sink=self._sink(channel),
                                              vad=fields.get("vad"), options=fields)
        except Refused as exc:
            self.worker.log_refusal(exc, session_id if isinstance(session_id, str) else None)
            self._queue(channel, {"type": "error", "code": exc.code, "message": str(exc)})
            return
        self.channels[channel] = handle
        self._queue(channel, self.worker.accepted())

    def _audio(self, channel: int, pcm: bytes) -> None:
        handle = self.channels.get(channel)
        if handle is not None:  # else closed; its audio was already in flight
            self.worker.feed(handle, pcm)

    def _end(self, channel: int) -> None:
        handle = self.channels.get(channel)
        if handle is not None:
            self.worker.end_audio(handle)

    def _commit(self, channel: int) -> None:
        handle = self.channels.get(channel)
        if handle is not None:
            self.worker.commit(handle)

    def _abandon(self, channel: int) -> None:
        handle = self.channels.pop(channel, None)
        if handle is not None:  # popped first: its Close is not sent
            self.worker.abandon(handle)
            self._freed()

    def abandon_all(self) -> None:
        for channel in list(self.channels):
            self._abandon(channel)

    # --- worker -> gateway ---------------------------------------------------------
    def _sink(self, channel: int) -> Callable[[Event | Close], None]:
        """Where the step loop posts the channel's events (and its ``Close``)."""
        def post(item: Event | Close) -> None:
            if channel not in self.channels:
                return  # abandoned, or already closed
            if isinstance(item, Close):
                del self.channels[channel]
                self._queue(channel, {"type": "closed", "code": item.code})
                self._freed()
            else:
                self._queue(channel, item)
        return post

    def _queue(self, channel: int, event: Event) -> None:
        self._outgoing.append((channel, event))
        self._wake.set()

    def _freed(self) -> None:
        """A slot goes back: the sender republishes the registry (once per wake-up)."""
        self._slots_changed = True
        self._wake.set()

    async def send(self) -> None:
        """Send what was queued as one message per wake-up, until sending fails."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._outgoing = self._outgoing, []
            if self._slots_changed:
                self._slots_changed = False
                self.worker.publish_soon()
            if not batch:
                continue
            try:
                await self.ws.send_str(json.dumps(batch, separators=(",", ":")))
            except (ConnectionError, RuntimeError):
                self.abandon_all()
                return


async def serve_link(worker: RealtimeWorker, request: web.Request) -> web.WebSocketResponse:
    """The ``/internal/v1/link`` handler: hello, then serve until the gateway goes."""
    ws = web.WebSocketResponse(max_msg_size=worker.settings.max_frame_bytes
                               + LINK_BATCH_BYTES + 1024,
                               heartbeat=heartbeat_s(worker.settings))
    await ws.prepare(request)
    await ws.send_json({"type": "link", "worker": worker.worker_id, "lane": worker.lane})
    link = Link(worker, ws)
    sender = asyncio.create_task(link.send())
    worker.links.add(ws)
    try:
        await link.receive()
    finally:
        worker.links.discard(ws)
        link.abandon_all()
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
    return ws
