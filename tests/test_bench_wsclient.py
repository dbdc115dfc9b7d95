"""bench.wsclient, the load generator's WebSocket client: RFC 6455 as a client must speak
it (issue 34: the hand-written one never checked ``Sec-WebSocket-Accept`` and masked
every frame with the all-zero key). A bare asyncio server plays the peer, so what the
client puts on the wire is read byte for byte."""

from __future__ import annotations

import asyncio
import base64
import hashlib

import pytest

from bench.wsclient import OP_TEXT, WebSocketError, connect

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def accept(key: bytes) -> bytes:
    return base64.b64encode(hashlib.sha1(key + GUID).digest())


async def test_a_wrong_accept_key_is_refused() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\nSec-WebSocket-Accept: "
                     + accept(b"not the key the client sent") + b"\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(WebSocketError):
            await connect(f"ws://127.0.0.1:{port}/v1/stream", lambda op, data: None,
                          timeout_s=10)
    finally:
        server.close()
        await server.wait_closed()


async def test_frames_are_masked_with_a_fresh_nonzero_key() -> None:
    firsts: list[tuple[bytes, bytes]] = []
    got: list[tuple[int, str | bytes]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        key = next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
                   if line.lower().startswith(b"sec-websocket-key:"))
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept(key)
                     + b"\r\n\r\n" + b"\x81\x10" + b'{"type":"ready"}')
        _, b1 = await reader.readexactly(2)
        assert b1 & 0x80, "a client frame must be masked"
        mask = await reader.readexactly(4)
        body = await reader.readexactly(b1 & 0x7F)
        firsts.append((mask, bytes(c ^ mask[i % 4] for i, c in enumerate(body))))
        writer.write(b"\x88\x02\x03\xe8")  # close 1000
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for _ in range(2):
            ws = await connect(f"ws://127.0.0.1:{port}/v1/stream",
                               lambda op, data: got.append((op, data)), timeout_s=10)
            await ws.send_bytes(b"\x01\x02\x03\x04\x05\x06\x07\x08")
            await asyncio.wait_for(ws.closed_event.wait(), 10)
            await ws.close()
    finally:
        server.close()
        await server.wait_closed()
    assert [body for _, body in firsts] == [b"\x01\x02\x03\x04\x05\x06\x07\x08"] * 2
    masks = [mask for mask, _ in firsts]
    assert b"\x00\x00\x00\x00" not in masks
    assert masks[0] != masks[1]
    assert [op for op, _ in got] == [OP_TEXT, OP_TEXT]
