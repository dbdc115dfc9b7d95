"""``link_linger_ms``: the gateway holds a worker link's audio that long, so that many
streams' frames leave in one WebSocket message (scenario 5's gateway CPU), and with 0
sends each event-loop tick's audio at once. The gateway's real ``WorkerLinks`` against
a real aiohttp server on loopback that answers the link's hello as a worker does and
records what arrives (docs/INTERNALS.md's link protocol)."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import WSMsgType, web

from gateway.links import WorkerLinks
from lanegate.constants import LINK_PATH, LINK_RECORD_HEADER
from lanegate.settings import Settings, SettingsError
from lanes.registry import WorkerInfo

STREAMS = 5
FRAME = b"\x01\x00" * 1600  # 100 ms of 16 kHz PCM


class Worker:
    """The link's far end: a hello, then every message kept."""

    def __init__(self) -> None:
        self.texts: list[dict[str, object]] = []
        self.binaries: list[bytes] = []
        self.got = asyncio.Event()

    async def link(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str(json.dumps({"type": "link", "worker": "w1", "lane": "realtime"}))
        async for msg in ws:
            if msg.type is WSMsgType.TEXT:
                self.texts.append(json.loads(msg.data))
            elif msg.type is WSMsgType.BINARY:
                self.binaries.append(msg.data)
            self.got.set()
        return ws

    def channels_per_message(self) -> list[list[int]]:
        """Each binary message's records, as the channel numbers they carry."""
        record = struct.Struct(LINK_RECORD_HEADER)
        out = []
        for data in self.binaries:
            numbers, pos = [], 0
            while pos < len(data):
                number, length = record.unpack_from(data, pos)
                numbers.append(number)
                pos += record.size + length
            out.append(numbers)
        return out


@pytest.fixture
async def worker() -> AsyncIterator[tuple[Worker, str]]:
    w = Worker()
    app = web.Application()
    app.router.add_get(LINK_PATH, w.link)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield w, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def send_one_frame_per_tick(url: str, worker: Worker, linger_ms: float) -> None:
    """Open ``STREAMS`` channels on one link, then queue one frame on each, one
    event-loop tick apart; wait until all of them reached the worker."""
    info = WorkerInfo("w1", "realtime", url, "simulated", 8, 8, 0.0)
    async with aiohttp.ClientSession() as http:
        links = WorkerLinks(http, Settings(link_linger_ms=linger_ms))
        try:
            link = await links.get(info)
            channels = [link.open(session_id=f"s{k}", sample_rate=16000, language="en")
                        for k in range(STREAMS)]
            while len(worker.texts) < STREAMS:  # the opens, before any audio
                worker.got.clear()
                await asyncio.wait_for(worker.got.wait(), 10)
            for channel in channels:
                assert channel.queue_audio(FRAME)
                await asyncio.sleep(0)  # the next frame in the next tick
            while sum(map(len, worker.channels_per_message())) < STREAMS:
                worker.got.clear()
                await asyncio.wait_for(worker.got.wait(), 10)
        finally:
            await links.close()


async def test_a_linger_sends_many_streams_frames_in_one_message(
    worker: tuple[Worker, str]
) -> None:
    w, url = worker
    # far longer than the five ticks take, so that a slow machine cannot split them
    await send_one_frame_per_tick(url, w, linger_ms=50)
    assert w.channels_per_message() == [list(range(STREAMS))]
    assert [t["op"] for t in w.texts] == ["open"] * STREAMS


async def test_no_linger_sends_each_ticks_frames_at_once(worker: tuple[Worker, str]) -> None:
    w, url = worker
    await send_one_frame_per_tick(url, w, linger_ms=0)
    assert w.channels_per_message() == [[k] for k in range(STREAMS)]


@pytest.mark.parametrize("value", ["-1", "51", "nan", "inf"])
def test_a_linger_outside_0_to_50_ms_is_refused(value: str) -> None:
    with pytest.raises(SettingsError, match="LINK_LINGER_MS"):
        Settings.from_env({"LANEGATE_LINK_LINGER_MS": value})


def test_the_default_linger_is_2_ms() -> None:
    assert Settings.from_env({}).link_linger_ms == 2.0
