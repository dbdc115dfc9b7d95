"""A ``/v1/stream`` socket's audio frames straight from the transport to the relay.

Through aiohttp, each client frame costs a reader queue, a future, a task wake-up and
a message object before the relay sees it: at hundreds of live streams, more of the
gateway's CPU than the relay itself (``bench/attribution.py``). A ``FrameTap`` sits
between the socket's transport and aiohttp's protocol and hands each whole, final,
masked binary frame to a synchronous sink as it arrives, answers pings (nobody reads
aiohttp's queue meanwhile) and drops pongs. From the first other frame on (text, close,
a fragment, a frame over the size cap, anything malformed) every byte goes to aiohttp,
which parses it as before. So the tap only ever takes a prefix of the stream's data
frames, and nothing it takes can overtake what aiohttp holds.

A tap starts in ``HOLD``: installed before the upgrade is answered, it keeps what
arrives until the relay ``attach``es its sink (or ``release`` hands it all to aiohttp,
for a stream refused before it starts).

    tap = FrameTap.install(request, max_payload=cap)  # None: not on this transport
    await ws.prepare(request)
    ...
    tap.attach(sink, on_release)  # sink(payload) -> None, or an awaitable to wait for
    ...                           # on_release(): aiohttp has the rest (once)
    tap.release()                 # aiohttp reads everything from here on
"""

from __future__ import annotations

import asyncio
import enum
import struct
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from aiohttp import web
from aiohttp._websocket.helpers import websocket_mask

from lanegate.logs import get_logger

log = get_logger("gateway.frame_tap")

TEXT, BINARY, CLOSE, PING, PONG = 0x1, 0x2, 0x8, 0x9, 0xA
#: ``unmask(mask, payload)``: XOR a bytearray in place with a 4-byte mask (aiohttp's C)
unmask = websocket_mask
#: a held stream (no sink yet) stops reading past this many bytes
HOLD_BYTES = 256 * 1024

#: what the sink does with one frame's payload: None when done, or an awaitable the tap
#: waits for (reading paused) before the next frame
Sink = Callable[[bytes], Awaitable[None] | None]


class FrameHead(NamedTuple):
    """A WebSocket frame header (RFC 6455, section 5.2); a tuple: one per frame, made
    cheaply."""

    fin: bool
    rsv: int
    opcode: int
    mask: bytes  # b"" when unmasked
    header_len: int  # with the mask
    length: int  # of the payload

    @property
    def end(self) -> int:
        return self.header_len + self.length


def frame_head(buf: bytes | bytearray) -> FrameHead | None:
    """The header of the frame at the start of ``buf``; None while it is incomplete."""
    if len(buf) < 2:
        return None
    b0, b1 = buf[0], buf[1]
    n, pos = b1 & 0x7F, 2
    if n >= 126:
        width = 2 if n == 126 else 8
        if len(buf) < pos + width:
            return None
        n, pos = int.from_bytes(buf[pos:pos + width], "big"), pos + width
    mask = b""
    if b1 & 0x80:
        if len(buf) < pos + 4:
            return None
        mask, pos = bytes(buf[pos:pos + 4]), pos + 4
    return FrameHead(bool(b0 & 0x80), b0 & 0x70, b0 & 0x0F, mask, pos, n)


def encode(opcode: int, payload: bytes) -> bytes:
    """One unmasked, final frame (a server's)."""
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x80 | opcode, 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 127, n)
    return head + payload


class Mode(enum.Enum):
    HOLD = "hold"  # keep what arrives until attach or release
    DIRECT = "direct"  # audio frames to the sink
    PASS = "pass"  # everything to aiohttp


class FrameTap(asyncio.Protocol):
    """The transport's protocol while the tap is installed; aiohttp's protocol
    (``inner``) gets everything the tap does not take (module docstring)."""

    def __init__(self, transport: asyncio.Transport, inner: asyncio.Protocol, *,
                 max_payload: int) -> None:
        self.transport = transport
        self.inner = inner
        self.max_payload = max_payload
        self.mode = Mode.HOLD
        self.frames = 0  # taken directly
        self._buf = bytearray()
        self._sink: Sink | None = None
        self._on_release: Callable[[], None] | None = None
        self._waiting = False  # for the sink's awaitable; reading is paused
        self._held_paused = False  # HOLD reached HOLD_BYTES; reading is paused
        self._wait_task: asyncio.Future[None] | None = None

    @classmethod
    def install(cls, request: web.Request, *, max_payload: int) -> FrameTap | None:
        """Put a tap under ``request``'s transport, before ``ws.prepare``; None when this
        transport cannot take one, or bytes already arrived after the upgrade request
        (aiohttp holds those; the stream stays on aiohttp's path)."""
        transport, inner = request.transport, request.protocol
        if transport is None or not hasattr(transport, "set_protocol") \
                or getattr(inner, "_message_tail", None) != b"":
            return None
        tap = cls(transport, inner, max_payload=max_payload)
        transport.set_protocol(tap)
        return tap

    # --- the relay's side ------------------------------------------------------------
    def attach(self, sink: Sink, on_release: Callable[[], None]) -> None:
        """Hand audio frames to ``sink`` from now on, those held first; ``on_release``
        is called once aiohttp reads the rest (at once if it already does)."""
        if self.mode is not Mode.HOLD:
            on_release()
            return
        self._sink, self._on_release, self.mode = sink, on_release, Mode.DIRECT
        self._unhold()
        self._drain()

    def release(self) -> None:
        """aiohttp reads everything from here on (safe to call twice)."""
        if self.mode is Mode.PASS:
            return
        self.mode = Mode.PASS
        on_release, self._sink, self._on_release = self._on_release, None, None
        rest, self._buf = bytes(self._buf), bytearray()
        if rest:
            self.inner.data_received(rest)
        self._unhold()
        if self._waiting:
            self._waiting = False
            self._resume()
        if on_release is not None:
            on_release()

    def _unhold(self) -> None:
        if self._held_paused:
            self._held_paused = False
            self._resume()

    # --- asyncio.Protocol ------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.mode is Mode.PASS:
            self.inner.data_received(data)
            return
        self._buf += data
        if self.mode is Mode.DIRECT:
            if not self._waiting:
                self._drain()
        elif len(self._buf) >= HOLD_BYTES and not self._held_paused:
            self._held_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        self.release()
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.release()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # --- taking frames -----------------------------------------------------------------
    def _drain(self) -> None:
        """Take the whole frames in the buffer: audio to the sink, pings answered,
        pongs dropped, and at the first other frame, the rest of the stream to aiohttp."""
        buf = self._buf
        while self.mode is Mode.DIRECT and not self._waiting:
            head = frame_head(buf)
            if head is None:
                return
            if not self._takes(head):
                self.release()  # aiohttp answers it, error or not
                return
            if len(buf) < head.end:
                return
            payload = buf[head.header_len:head.end]
            del buf[:head.end]
            unmask(head.mask, payload)
            if head.opcode == BINARY:
                self._take(bytes(payload))
            elif head.opcode == PING and not self.transport.is_closing():
                self.transport.write(encode(PONG, bytes(payload)))

    def _takes(self, head: FrameHead) -> bool:
        """A frame the tap handles: final, masked, with no extension bits; audio within
        the size cap, or a ping or pong."""
        if not head.fin or head.rsv or not head.mask:
            return False
        if head.opcode == BINARY:
            return head.length <= self.max_payload
        return head.opcode in (PING, PONG) and head.length <= 125

    def _take(self, payload: bytes) -> None:
        assert self._sink is not None
        self.frames += 1
        pending = self._sink(payload)
        if pending is not None:
            self._waiting = True
            self.transport.pause_reading()
            self._wait_task = asyncio.ensure_future(self._wait(pending))

    async def _wait(self, pending: Awaitable[None]) -> None:
        try:
            await pending
        except Exception:  # the sink's own failure; the relay has seen it
            log.exception("frame_tap_sink_failed")
            self.release()
            return
        if not self._waiting:
            return  # released meanwhile
        self._waiting = False
        self._resume()
        self._drain()

    def _resume(self) -> None:
        if not self.transport.is_closing():
            self.transport.resume_reading()

