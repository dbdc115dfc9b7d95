"""bench.floor and bench.floor_protocol: the bare servers that scenario 5 and
bench.attribution set the gateway against speak enough of /v1/stream for the load
generator, at the event rate they document."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from bench import floor_protocol
from bench.floor import FINAL_EVERY_FRAMES, PARTIAL_EVERY_FRAMES
from bench.floor_protocol import BadFrame, next_frame
from bench.load import BYTES_PER_MS, StreamResult, StreamSpec, run_live
from bench.stack import listening
from lanegate.supervisor import free_port


@pytest_asyncio.fixture
async def protocol_floor_url() -> AsyncIterator[str]:
    port = free_port()
    server = await floor_protocol.serve(port)
    yield f"ws://127.0.0.1:{port}/v1/stream"
    server.close()
    await server.wait_closed()


@pytest_asyncio.fixture
async def protocol_floor_process_url() -> AsyncIterator[str]:
    """``python -m bench.floor_protocol`` as the bench runs it: its own process, uvloop."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.floor_protocol", "--port", str(port))
    try:
        for _ in range(100):
            if await listening(port):
                break
            await asyncio.sleep(0.1)
        yield f"ws://127.0.0.1:{port}/v1/stream"
    finally:
        proc.terminate()
        await proc.wait()


@pytest.fixture(params=["floor", "floor_protocol", "floor_protocol_process"])
def any_floor_url(request: pytest.FixtureRequest) -> str:
    name = {"floor": "floor_url", "floor_protocol": "protocol_floor_url",
            "floor_protocol_process": "protocol_floor_process_url"}[request.param]
    url = request.getfixturevalue(name)
    assert isinstance(url, str)
    return url


async def test_a_load_stream_gets_ready_partials_finals_and_done(any_floor_url: str) -> None:
    frames = FINAL_EVERY_FRAMES  # 100 ms frames at real time: 5 s
    spec = StreamSpec(kind="live", url=any_floor_url, pcm_path="", duration_s=frames / 10)
    pcm = bytes(BYTES_PER_MS * 100 * frames)
    result = StreamResult(kind="live")
    started = time.perf_counter()
    await run_live(spec, pcm, started, result)
    assert result.error == ""
    assert result.lane == "floor"
    assert result.frames_sent == frames + 1  # the audio and `end`
    finals = frames // FINAL_EVERY_FRAMES
    partials = frames // PARTIAL_EVERY_FRAMES - finals
    assert len(result.final_text) == finals
    # ready, the events, done: 2.2 events per 10 frames, the gateway's rate
    assert result.events_received == 1 + partials + finals + 1
    assert len(result.partial_ms) == partials  # each maps back to the frame it ends


async def test_the_protocol_floor_answers_a_ping_and_a_close(protocol_floor_url: str) -> None:
    async with aiohttp.ClientSession() as http, \
            http.ws_connect(protocol_floor_url, autoping=False) as ws:
        assert (await ws.receive_json())["type"] == "ready"
        await ws.ping(b"hi")
        pong = await ws.receive()
        assert (pong.type, pong.data) == (aiohttp.WSMsgType.PONG, b"hi")
        await ws.close()
        assert ws.closed


def test_a_frame_is_taken_only_once_whole_and_is_unmasked() -> None:
    masked = bytes([0x81, 0x80 | 5, 1, 2, 3, 4, 0x61 ^ 1, 0x62 ^ 2, 0x63 ^ 3, 0x64 ^ 4,
                    0x65 ^ 1])
    buf = bytearray(masked[:5])
    assert next_frame(buf) is None  # incomplete: left in place
    buf += masked[5:] + b"\x82"  # the rest, and the first byte of the next frame
    assert next_frame(buf) == (0x1, bytearray(b"abcde"))
    assert buf == bytearray(b"\x82")


def test_binary_audio_is_taken_whole_and_only_its_length_read() -> None:
    audio = bytes([0x82, 0x80 | 3, 1, 2, 3, 4, 9, 9, 9])
    buf = bytearray(audio)
    opcode, payload = next_frame(buf) or (0, bytearray())
    assert (opcode, len(payload), buf) == (0x2, 3, bytearray())


def test_a_long_frame_reads_its_extended_length() -> None:
    payload = bytes(300)
    buf = bytearray(bytes([0x82, 126]) + (300).to_bytes(2, "big") + payload)
    assert next_frame(buf) == (0x2, bytearray(payload))
    assert not buf


def test_a_fragment_is_refused() -> None:
    with pytest.raises(BadFrame):
        next_frame(bytearray([0x02, 0x00]))  # FIN clear: the start of a fragmented message
