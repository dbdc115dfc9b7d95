"""A minimal RFC 6455 WebSocket client for the load generator.

The benchmark's clients share the machine with the gateway and the workers they
measure, so they should cost as little as possible. This client is an
``asyncio.Protocol``: frames are parsed in ``data_received`` and
handed to a callback, with no task switch per message, and outgoing frames are
written straight to the transport. Client frames carry the all-zero masking key:
a valid key (the server unmasks with it as with any other) that leaves the
payload as is, so no per-byte work is done. (Measured: 500 streams still cost the
clients about 0.4 core on the benchmark's VM, as with aiohttp's client; what is
left is the kernel's per-message socket work, one send and one receive per frame.)
Not for production use: no extensions, no fragmentation of outgoing frames.
"""

from __future__ import annotations

import asyncio
import base64
import os
import struct
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
ZERO_MASK = b"\x00\x00\x00\x00"
OnMessage = Callable[[int, bytes], None]


class WebSocketError(Exception):
    """The handshake was refused or the peer broke the protocol."""


def frame(opcode: int, payload: bytes) -> bytes:
    """One final, masked (all-zero key) client frame."""
    n = len(payload)
    if n < 126:
        header = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n < 1 << 16:
        header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    return header + ZERO_MASK + payload


def parse_frame(buf: bytearray) -> tuple[bool, int, bytes, int] | None:
    """(fin, opcode, payload, frame length) of the frame at the start of ``buf``, or None
    if it is not all there yet."""
    if len(buf) < 2:
        return None
    b0, b1 = buf[0], buf[1]
    if b1 & 0x80:
        raise WebSocketError("a server frame must not be masked")
    n, head = b1 & 0x7F, 2
    if n == 126:
        if len(buf) < 4:
            return None
        n, head = struct.unpack_from("!H", buf, 2)[0], 4
    elif n == 127:
        if len(buf) < 10:
            return None
        n, head = struct.unpack_from("!Q", buf, 2)[0], 10
    if len(buf) < head + n:
        return None
    return bool(b0 & 0x80), b0 & 0x0F, bytes(buf[head:head + n]), head + n


class RawWebSocket(asyncio.Protocol):
    """One connection; ``on_message(opcode, payload)`` gets each text/binary message."""

    def __init__(self, on_message: OnMessage) -> None:
        self.on_message = on_message
        self.close_code: int | None = None
        self.closed_event = asyncio.Event()
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._fragments: list[bytes] = []
        self._fragment_op = 0
        self._writable = asyncio.Event()
        self._writable.set()

    @classmethod
    async def connect(cls, url: str, on_message: OnMessage,
                      timeout_s: float = 30.0) -> RawWebSocket:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        key = base64.b64encode(os.urandom(16)).decode()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout_s):
            _, ws = await loop.create_connection(lambda: cls(on_message), host, port)
            assert ws._transport is not None
            ws._transport.write((f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                                 "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                                 f"Sec-WebSocket-Key: {key}\r\n"
                                 "Sec-WebSocket-Version: 13\r\n\r\n").encode())
            await ws._opened
        return ws

    # --- asyncio.Protocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing it
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if not self._opened.done() and not self._handshake():
            return
        try:
            while (parsed := parse_frame(self._buf)) is not None:
                fin, opcode, payload, size = parsed
                del self._buf[:size]
                self._on_frame(fin, opcode, payload)
        except WebSocketError:
            self._mark_closed(1002)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self._writable.set()
        if not self._opened.done():
            self._opened.set_exception(ConnectionError("closed during the handshake"))
        self._mark_closed(self.close_code)

    # --- frames ----------------------------------------------------------------------
    def _handshake(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        status_line = bytes(self._buf[: self._buf.find(b"\r\n")])
        del self._buf[: end + 4]
        status = status_line.split()
        if len(status) < 2 or status[1] != b"101":
            self._opened.set_exception(WebSocketError(f"handshake refused: {status_line!r}"))
            self._mark_closed(None)
            return False
        self._opened.set_result(None)
        return True

    def _on_frame(self, fin: bool, opcode: int, payload: bytes) -> None:
        if opcode == OP_PING:
            self._write(frame(OP_PONG, payload))
        elif opcode == OP_CLOSE:
            code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
            self._write(frame(OP_CLOSE, payload[:2]))
            self._mark_closed(code)
        elif opcode in (OP_TEXT, OP_BINARY, OP_CONT):
            if opcode != OP_CONT:
                self._fragment_op = opcode
            self._fragments.append(payload)
            if fin:
                message, self._fragments = b"".join(self._fragments), []
                self.on_message(self._fragment_op, message)

    # --- sending ---------------------------------------------------------------------
    async def send_bytes(self, data: bytes) -> None:
        await self._send(OP_BINARY, data)

    async def send_str(self, text: str) -> None:
        await self._send(OP_TEXT, text.encode())

    async def _send(self, opcode: int, payload: bytes) -> None:
        if self.closed or self._transport is None:
            raise ConnectionError("websocket is closed")
        self._write(frame(opcode, payload))
        if not self._writable.is_set():  # the transport's buffer is over its high-water mark
            await self._writable.wait()

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    @property
    def closed(self) -> bool:
        return self.closed_event.is_set()

    def _mark_closed(self, code: int | None) -> None:
        if not self.closed:
            self.close_code = code
            self.closed_event.set()
            if self._transport is not None:
                self._transport.close()

    async def close(self, code: int = 1000) -> None:
        if not self.closed:
            self._write(frame(OP_CLOSE, struct.pack("!H", code)))
            self._mark_closed(code)
