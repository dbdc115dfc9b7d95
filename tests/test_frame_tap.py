"""gateway/frame_tap.py: audio frames from the socket to a sink without aiohttp's
reader, in order, with everything else (text, close, oversized frames) still parsed
and answered by aiohttp. A real aiohttp server on loopback; real aiohttp clients, and
a raw socket client where a test needs frames cut at odd byte boundaries."""

from __future__ import annotations

import asyncio
import base64
import os
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import WSMsgType, web

from gateway.frame_tap import BINARY, CLOSE, PING, PONG, TEXT, FrameTap, Mode, frame_head

CAP = 64 * 1024


@dataclass
class Server:
    """What the tapped handler saw: frames its sink took, then what aiohttp gave it."""

    url: str
    taken: list[bytes] = field(default_factory=list)
    read: list[tuple[str, bytes | str]] = field(default_factory=list)
    taps: list[FrameTap] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    #: how the handler uses its tap: "attach" (after ``hold_s``) or "release"
    use: str = "attach"
    hold_s: float = 0.0
    #: the sink's answer per frame number (None: taken at once)
    pending: Callable[[int], Awaitable[None] | None] = lambda n: None


@pytest_asyncio.fixture
async def server() -> AsyncIterator[Server]:
    srv = Server(url="")

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=CAP * 2, autoclose=False)
        tap = FrameTap.install(request, max_payload=CAP)
        assert tap is not None
        srv.taps.append(tap)
        await ws.prepare(request)
        await asyncio.sleep(srv.hold_s)
        if srv.use == "release":
            tap.release()
        else:
            released = asyncio.Event()

            def sink(data: bytes) -> Awaitable[None] | None:
                srv.taken.append(data)
                return srv.pending(len(srv.taken))

            tap.attach(sink, released.set)
            await released.wait()
        async for msg in ws:
            if msg.type is WSMsgType.TEXT:
                srv.read.append(("text", msg.data))
                if msg.data == "bye":
                    await ws.close()
            elif msg.type is WSMsgType.BINARY:
                srv.read.append(("binary", msg.data))
        if ws.close_code is not None:
            srv.read.append(("close", str(ws.close_code)))
        srv.done.set()
        return ws

    app = web.Application()
    app.router.add_get("/ws", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    srv.url = f"http://127.0.0.1:{port}/ws"
    yield srv
    await runner.cleanup()


def frames(n: int, size: int = 3200) -> list[bytes]:
    return [bytes([k % 251]) * size for k in range(n)]


async def test_audio_frames_reach_the_sink_in_order_then_aiohttp_reads_on(
        server: Server) -> None:
    server.hold_s = 0.2  # some arrive while the tap holds them
    audio = frames(20)
    async with aiohttp.ClientSession() as http, http.ws_connect(server.url) as ws:
        for frame in audio[:10]:
            await ws.send_bytes(frame)
        await ws.send_str("end")  # the first other frame: aiohttp reads from here on
        for frame in audio[10:]:
            await ws.send_bytes(frame)
        await ws.send_str("bye")
        msg = await ws.receive()
        assert msg.type is WSMsgType.CLOSE
    await asyncio.wait_for(server.done.wait(), 5)
    assert server.taken == audio[:10]
    assert server.taps[0].frames == 10
    assert server.taps[0].mode is Mode.PASS
    assert server.read == [("text", "end"), *[("binary", f) for f in audio[10:]],
                           ("text", "bye"), ("close", "1000")]


async def test_the_tap_answers_a_ping_with_its_payload(server: Server) -> None:
    async with aiohttp.ClientSession() as http, \
            http.ws_connect(server.url, autoping=False) as ws:
        await ws.send_bytes(b"\x00\x01" * 100)
        await ws.ping(b"are you there")
        msg = await asyncio.wait_for(ws.receive(), 5)
        assert msg.type is WSMsgType.PONG
        assert msg.data == b"are you there"
        await ws.send_bytes(b"\x02\x03" * 100)
        await ws.send_str("bye")
        assert (await ws.receive()).type is WSMsgType.CLOSE
    await asyncio.wait_for(server.done.wait(), 5)
    assert server.taken == [b"\x00\x01" * 100, b"\x02\x03" * 100]


async def test_a_frame_over_the_cap_goes_to_aiohttp_which_refuses_it(server: Server) -> None:
    async with aiohttp.ClientSession() as http, http.ws_connect(server.url) as ws:
        await ws.send_bytes(b"\x00" * 1000)
        await ws.send_bytes(b"\x00" * (CAP * 2 + 2))  # over aiohttp's max_msg_size too
        msg = await asyncio.wait_for(ws.receive(), 5)
        assert msg.type is WSMsgType.CLOSE
        assert msg.data == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
    await asyncio.wait_for(server.done.wait(), 5)
    assert server.taken == [b"\x00" * 1000]


async def test_a_tap_released_before_attach_leaves_every_frame_to_aiohttp(
        server: Server) -> None:
    server.use, server.hold_s = "release", 0.2
    audio = frames(5)
    async with aiohttp.ClientSession() as http, http.ws_connect(server.url) as ws:
        for frame in audio:
            await ws.send_bytes(frame)
        await ws.send_str("bye")
        assert (await ws.receive()).type is WSMsgType.CLOSE
    await asyncio.wait_for(server.done.wait(), 5)
    assert server.taken == []
    assert server.read[:5] == [("binary", f) for f in audio]


async def test_a_sink_that_must_wait_holds_the_next_frames_back_in_order(
        server: Server) -> None:
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()
    server.pending = lambda n: gate if n == 3 else None
    audio = frames(12)
    async with aiohttp.ClientSession() as http, http.ws_connect(server.url) as ws:
        for frame in audio:
            await ws.send_bytes(frame)
        await asyncio.sleep(0.2)
        assert server.taken == audio[:3]  # frame 3's sink is still waiting
        gate.set_result(None)
        await ws.send_str("bye")
        assert (await ws.receive()).type is WSMsgType.CLOSE
    await asyncio.wait_for(server.done.wait(), 5)
    assert server.taken == audio


def masked(opcode: int, payload: bytes) -> bytes:
    """A client's frame."""
    mask = os.urandom(4)
    n = len(payload)
    head = struct.pack("!BB", 0x80 | opcode, 0x80 | n) if n < 126 else \
        struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def test_frames_cut_at_any_byte_arrive_whole(server: Server) -> None:
    host, port = server.url.split("//")[1].split("/")[0].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(f"GET /ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
                 f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                 "Sec-WebSocket-Version: 13\r\n\r\n".encode())
    assert b" 101 " in await reader.readuntil(b"\r\n\r\n")
    audio = [bytes([k]) * (100 + 37 * k) for k in range(8)]  # short and extended lengths
    wire = b"".join(masked(BINARY, f) for f in audio) + masked(PING, b"p") \
        + masked(TEXT, b"bye")
    for cut in range(0, len(wire), 7):  # 7-byte pieces: headers and masks split too
        writer.write(wire[cut:cut + 7])
        await writer.drain()
        await asyncio.sleep(0)
    pong = await asyncio.wait_for(reader.readexactly(3), 5)
    assert pong == bytes([0x80 | PONG, 1]) + b"p"
    close = await asyncio.wait_for(reader.readexactly(4), 5)  # the handler's, to "bye"
    assert close == bytes([0x80 | CLOSE, 2]) + struct.pack("!H", 1000)
    writer.write(masked(CLOSE, struct.pack("!H", 1000)))
    await asyncio.wait_for(server.done.wait(), 5)
    writer.close()
    assert server.taken == audio
    assert server.read[0] == ("text", "bye")


@pytest.mark.parametrize(("wire", "expected"), [
    (b"\x82", None),
    (b"\x82\xfe\x01", None),  # extended length incomplete
    (b"\x82\x85\x01\x02", None),  # mask incomplete
    (b"\x82\x85\x01\x02\x03\x04", (True, 0, BINARY, 6, 5)),
    (b"\x02\x7e\x01\x00", (False, 0, BINARY, 4, 256)),
    (b"\xc1\x03abc", (True, 0x40, TEXT, 2, 3)),
])
def test_frame_head(wire: bytes, expected: tuple[bool, int, int, int, int] | None) -> None:
    head = frame_head(wire)
    if expected is None:
        assert head is None
    else:
        assert head is not None
        assert (head.fin, head.rsv, head.opcode, head.header_len, head.length) == expected
