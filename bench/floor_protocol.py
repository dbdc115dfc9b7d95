"""The floor below aiohttp: ``bench.floor``'s server on a bare asyncio ``Protocol`` that
parses the WebSocket frames itself, so that no per-message machinery of a WebSocket
library (its reader's queue, a future and a task wake-up per message, a message
object) is in the figure. What it costs per stream-second is what any Python server on
this event loop pays to take these frames off the socket and answer at the gateway's
event rate; the gap to ``bench.floor`` is aiohttp's share.

    python -m bench.floor_protocol --port PORT [--quiet]

It speaks only what ``bench.load`` sends: one upgrade request, then unfragmented frames
without extensions (binary audio, a text ``end``, close, ping). The events, their rate
and ``--quiet`` are ``bench.floor``'s.

It uses no library's internals. Frames it reads (text, ping, close: a few bytes) are
unmasked here; binary audio, of which it reads only the length, is left masked. The
gateway's aiohttp unmasks audio in C, 0.1 us per 100 ms frame (3200 bytes, measured
beside this floor), a thousandth of this floor's cost per frame; unmasking it here in
Python (numpy: 4 us, int XOR: 14 us) would raise the floor by 5-20 % with work no
Python server pays.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import struct
from typing import cast

from bench.floor import FINAL_EVERY_FRAMES, PARTIAL_EVERY_FRAMES, event
from bench.load import BYTES_PER_MS
from lanegate.loops import run

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455, section 1.3
TEXT, BINARY, CLOSE, PING, PONG = 0x1, 0x2, 0x8, 0x9, 0xA
MAX_HEADER_BYTES = 16 * 1024


class BadFrame(Exception):
    """The peer sent what this floor does not speak."""


def accept_key(request_head: bytes) -> str:
    """``Sec-WebSocket-Accept`` for an upgrade request's header block."""
    for line in request_head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"sec-websocket-key":
            digest = hashlib.sha1(value.strip() + WS_GUID).digest()
            return base64.b64encode(digest).decode("ascii")
    raise BadFrame("no Sec-WebSocket-Key in the upgrade request")


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


def unmask(mask: bytes, payload: bytearray) -> None:
    """XOR ``payload`` in place with the frame's 4-byte masking key (RFC 6455, 5.3)."""
    for i in range(len(payload)):
        payload[i] ^= mask[i & 3]


def next_frame(buf: bytearray) -> tuple[int, bytearray] | None:
    """Take the first whole frame off ``buf``: its opcode and payload, None while it is
    incomplete. The payload is unmasked, except a binary frame's (only its length is
    read here; see the module's docstring)."""
    if len(buf) < 2:
        return None
    b0, b1 = buf[0], buf[1]
    if b0 & 0x70 or not b0 & 0x80:
        raise BadFrame("fragmented frames and extensions are not spoken here")
    n, pos = b1 & 0x7F, 2
    if n >= 126:
        width = 2 if n == 126 else 8
        if len(buf) < pos + width:
            return None
        n, pos = int.from_bytes(buf[pos:pos + width], "big"), pos + width
    mask_len = 4 if b1 & 0x80 else 0
    end = pos + mask_len + n
    if len(buf) < end:
        return None
    payload = buf[pos + mask_len:end]
    opcode = b0 & 0x0F
    if mask_len and opcode != BINARY:
        unmask(bytes(buf[pos:pos + 4]), payload)
    del buf[:end]
    return opcode, payload


class FloorProtocol(asyncio.Protocol):
    """One client connection: the upgrade, then ``bench.floor``'s answers per frame."""

    def __init__(self, *, quiet: bool = False) -> None:
        self.quiet = quiet
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.upgraded = False
        self.frames = self.audio_ms = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCP transport has a Transport's methods but is no subclass of it
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        try:
            if not self.upgraded and not self._upgrade():
                return
            while (frame := next_frame(self.buf)) is not None:
                self._on_frame(*frame)
        except BadFrame:
            self._send(CLOSE, struct.pack("!H", 1002))  # protocol error
            self._close()

    def _upgrade(self) -> bool:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEADER_BYTES:
                raise BadFrame("upgrade request too long")
            return False
        key = accept_key(bytes(self.buf[:end]))
        del self.buf[:end + 4]
        self._write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                    b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + key.encode() + b"\r\n\r\n")
        self._send(TEXT, json.dumps({"type": "ready", "lane": "floor"}).encode())
        self.upgraded = True
        return True

    def _on_frame(self, opcode: int, payload: bytearray) -> None:
        if opcode == BINARY:
            self.frames += 1
            self.audio_ms += len(payload) // BYTES_PER_MS
            if self.quiet:
                return
            if self.frames % FINAL_EVERY_FRAMES == 0:
                self._send(TEXT, event("final", self.audio_ms).encode())
            elif self.frames % PARTIAL_EVERY_FRAMES == 0:
                self._send(TEXT, event("partial", self.audio_ms).encode())
        elif opcode == TEXT:  # ``end``: the only control the load sends
            self._send(TEXT, b'{"type":"done"}')
            self._send(CLOSE, struct.pack("!H", 1000))
        elif opcode == PING:
            self._send(PONG, bytes(payload))
        elif opcode == CLOSE:
            self._close()

    def _send(self, opcode: int, payload: bytes) -> None:
        self._write(encode(opcode, payload))

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def serve(port: int, *, quiet: bool = False) -> asyncio.Server:
    """The floor listening on loopback ``port`` (0: a free one)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: FloorProtocol(quiet=quiet), "127.0.0.1", port)


async def serve_forever(port: int, quiet: bool) -> None:
    server = await serve(port, quiet=quiet)
    await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.floor_protocol")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--quiet", action="store_true", help="send no partials or finals")
    a = p.parse_args()
    run(serve_forever(a.port, a.quiet), "uvloop")  # the gateway's loop, as bench.floor


if __name__ == "__main__":
    main()
