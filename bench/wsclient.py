"""A minimal RFC 6455 WebSocket client for the load generator.

The benchmark's clients share the machine with the gateway and the workers they
measure, so they must cost as little as possible: with aiohttp's client, 500
streams took about half a core, CPU the server under test then lacked. This
client writes prebuilt frames straight to the transport and parses only what
the load needs (text, binary, ping, close). Client frames carry the all-zero
masking key: a valid key (the server unmasks with it as with any other) that
leaves the payload as is, so no per-byte work is done.
Not for production use: no extensions, no fragmentation of outgoing frames.
"""

from __future__ import annotations

import asyncio
import base64
import os
import struct
from urllib.parse import urlsplit

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
ZERO_MASK = b"\x00\x00\x00\x00"


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


class RawWebSocket:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self.closed = False
        self.close_code: int | None = None

    @classmethod
    async def connect(cls, url: str, timeout_s: float = 30.0) -> RawWebSocket:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        key = base64.b64encode(os.urandom(16)).decode()
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write((f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                          "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                          f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                          ).encode())
            head = await reader.readuntil(b"\r\n\r\n")
        status_line = head.split(b"\r\n", 1)[0]
        status = status_line.split()
        if len(status) < 2 or status[1] != b"101":
            writer.close()
            raise WebSocketError(f"handshake refused: {status_line!r}")
        return cls(reader, writer)

    async def send_bytes(self, data: bytes) -> None:
        await self._send(OP_BINARY, data)

    async def send_str(self, text: str) -> None:
        await self._send(OP_TEXT, text.encode())

    async def _send(self, opcode: int, payload: bytes) -> None:
        if self.closed:
            raise ConnectionError("websocket is closed")
        self._writer.write(frame(opcode, payload))
        if self._writer.transport.get_write_buffer_size() > 1 << 20:
            await self._writer.drain()

    async def receive(self) -> tuple[int, bytes] | None:
        """The next text or binary message as (opcode, payload); None once closed."""
        while not self.closed:
            try:
                opcode, payload = await self._read_frame()
            except (asyncio.IncompleteReadError, ConnectionError):
                self._mark_closed(None)
                return None
            if opcode in (OP_TEXT, OP_BINARY):
                return opcode, payload
            if opcode == OP_PING:
                await self._send(OP_PONG, payload)
            elif opcode == OP_CLOSE:
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
                if not self.closed:
                    self._writer.write(frame(OP_CLOSE, payload[:2]))
                self._mark_closed(code)
        return None

    async def _read_frame(self) -> tuple[int, bytes]:
        """One whole message (continuation frames joined)."""
        opcode, chunks = -1, []
        while True:
            b0, b1 = await self._reader.readexactly(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack("!H", await self._reader.readexactly(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", await self._reader.readexactly(8))[0]
            if b1 & 0x80:
                raise WebSocketError("a server frame must not be masked")
            chunks.append(await self._reader.readexactly(n) if n else b"")
            if b0 & 0x0F != OP_CONT:
                opcode = b0 & 0x0F
            if b0 & 0x80:
                return opcode, b"".join(chunks)

    def _mark_closed(self, code: int | None) -> None:
        self.closed = True
        self.close_code = code
        self._writer.close()

    async def close(self, code: int = 1000) -> None:
        if not self.closed:
            self._writer.write(frame(OP_CLOSE, struct.pack("!H", code)))
            self._mark_closed(code)
