"""Wyoming (Home Assistant's protocol) end to end: the real ``wyoming`` package's
``AsyncTcpClient`` against a whole stack with the real Whisper base engine (auth off, as
Wyoming is served only then), espeak-ng speech; and, without a worker, the port staying
closed while API keys are set."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import RedisServer, read_pcm
from phrases import MOST, TALKING, TRAFFIC, recall, spoken
from stack import Stack, lone_gateway, start_stack
from wyoming.asr import Transcribe, Transcript, TranscriptChunk, TranscriptStart
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event, async_read_event
from wyoming.info import Describe, Info

from engines import models
from lanegate.settings import Settings
from lanegate.supervisor import banner, free_port

SPOKEN = spoken(TRAFFIC, TALKING)  # two utterances: two finals, two transcript-chunks
RATE = 16000
CHUNK = RATE * 2 // 10  # 100 ms of 16-bit mono
EVENT_WAIT_S = 120.0  # Whisper on two shared cores, with other tests running


@pytest.fixture(scope="module")
def wyoming_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, whisper_data: Path,
          wyoming_port: int) -> Iterator[Stack]:
    running = start_stack(tmp_path_factory.mktemp("wyoming-stack"), batch=False, settings={
        "LANEGATE_ENGINE": "whisper",
        "LANEGATE_WHISPER_MODEL": str(models.resolve("base", str(whisper_data))),
        "LANEGATE_WYOMING_PORT": str(wyoming_port),
        "LANEGATE_SLOTS": "4",  # max_key_share 0.5: two sessions per client address
    }, realtime_slots=4)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def pcm(speech: Callable[..., Path]) -> bytes:
    audio, rate = read_pcm(speech(SPOKEN))
    assert rate == RATE
    return audio + bytes(RATE * 2)  # a second of silence: the last utterance's endpoint


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text: str = resp.read().decode()
    return text


def client(port: int) -> AsyncTcpClient:
    return AsyncTcpClient("127.0.0.1", port, read_timeout=EVENT_WAIT_S)


async def send_audio(wy: AsyncTcpClient, pcm: bytes) -> None:
    await wy.write_event(AudioStart(rate=RATE, width=2, channels=1).event())
    for offset in range(0, len(pcm), CHUNK):
        await wy.write_event(AudioChunk(rate=RATE, width=2, channels=1,
                                        audio=pcm[offset:offset + CHUNK]).event())


async def until(wy: AsyncTcpClient, *kinds: str) -> list[Event]:
    """Events up to and including the first of ``kinds``."""
    seen: list[Event] = []
    while True:
        event = await wy.read_event()
        assert event is not None, f"connection closed after {[e.type for e in seen]}"
        seen.append(event)
        if event.type in kinds:
            return seen


async def transcribe(port: int, pcm: bytes) -> list[Event]:
    async with client(port) as wy:
        await wy.write_event(Transcribe(language="en").event())
        await send_audio(wy, pcm)
        await wy.write_event(AudioStop().event())
        return await until(wy, "transcript-stop", "error")


async def test_describe_answers_info_with_an_asr_program(stack: Stack, wyoming_port: int) -> None:
    async with client(wyoming_port) as wy:
        await wy.write_event(Describe().event())
        event = await wy.read_event()
    assert event is not None
    assert Info.is_type(event.type), event
    (program,) = Info.from_event(event).asr
    assert program.installed
    assert program.supports_transcript_streaming
    (model,) = program.models
    assert model.name == Path(stack.env["LANEGATE_WHISPER_MODEL"]).name  # whisper-base-...
    assert {"en", "de", "es"} <= set(model.languages)


async def test_a_transcription_streams_chunks_then_the_transcript(
        stack: Stack, wyoming_port: int, pcm: bytes) -> None:
    async with client(wyoming_port) as wy:
        await wy.write_event(Transcribe(language="en").event())
        await send_audio(wy, pcm)
        # before audio-stop: the realtime lane's finals already come as chunks
        early = await until(wy, "transcript-chunk")
        await wy.write_event(AudioStop().event())
        rest = await until(wy, "transcript-stop")
    events = early + rest
    kinds = [e.type for e in events]
    assert kinds[0] == "transcript-start", kinds
    assert kinds[-2:] == ["transcript", "transcript-stop"], kinds
    assert set(kinds[1:-2]) == {"transcript-chunk"}, kinds
    assert TranscriptStart.from_event(events[0]).language == "en"
    transcript = Transcript.from_event(events[-2])
    chunks = "".join(TranscriptChunk.from_event(e).text for e in events[1:-2])
    assert chunks == transcript.text
    assert len(kinds) - 3 >= 2, f"a chunk per utterance: {kinds}"
    assert transcript.language == "en"
    assert recall(SPOKEN, transcript.text) >= MOST, transcript.text


async def test_a_wrong_payload_length_gets_an_error_and_takes_nothing_from_others(
        stack: Stack, wyoming_port: int, pcm: bytes) -> None:
    healthy = asyncio.create_task(transcribe(wyoming_port, pcm))
    # an audio chunk that is not whole 16-bit samples: that transcription ends, with an
    # error, and the connection goes on
    async with client(wyoming_port) as wy:
        await send_audio(wy, pcm[:CHUNK * 5])
        await wy.write_event(Event(type="audio-chunk",
                                   data={"rate": RATE, "width": 2, "channels": 1},
                                   payload=b"\x01\x02\x03"))
        (error,) = [e for e in await until(wy, "error") if e.type == "error"]
        assert Error.from_event(error).code == "bad_request", error
        assert "16-bit" in Error.from_event(error).text
        await wy.write_event(AudioStop().event())
        await wy.write_event(Describe().event())
        assert [e.type for e in await until(wy, "info")] == ["info"]
    # a header whose payload_length is over max_frame_bytes or not a number, data over
    # wyoming_max_event_bytes, a header line over it: the framing is lost, so an error
    # and the connection closes
    fmt = {"rate": RATE, "width": 2, "channels": 1}
    limits = Settings()
    lying = {
        "too_large": [{"type": "audio-chunk", "data": fmt,
                       "payload_length": limits.max_frame_bytes + 1},
                      {"type": "transcribe", "data_length": limits.wyoming_max_event_bytes + 1},
                      {"type": "describe", "data": {"pad": "x" * limits.wyoming_max_event_bytes}}],
        "bad_request": [{"type": "audio-chunk", "data": fmt, "payload_length": "12"},
                        {"type": "audio-chunk", "data": fmt, "payload_length": -1}],
    }
    for code, headers in lying.items():
        for header in headers:
            reader, writer = await asyncio.open_connection("127.0.0.1", wyoming_port)
            writer.write(json.dumps(header).encode() + b"\n" + bytes(64))
            await writer.drain()
            event = await asyncio.wait_for(async_read_event(reader), EVENT_WAIT_S)
            assert event is not None
            assert (event.type, event.data["code"]) == ("error", code), (header.keys(), event)
            with contextlib.suppress(ConnectionResetError):  # closed, either way
                assert await asyncio.wait_for(reader.read(), EVENT_WAIT_S) == b""
            writer.close()
    events = await healthy
    assert events[-1].type == "transcript-stop", [e.type for e in events]
    text = Transcript.from_event(events[-2]).text
    assert recall(SPOKEN, text) >= MOST, text


async def test_the_per_address_session_limit_holds(stack: Stack, wyoming_port: int,
                                                   pcm: bytes) -> None:
    async with client(wyoming_port) as one, client(wyoming_port) as two, \
            client(wyoming_port) as three:
        for wy in (one, two):
            await send_audio(wy, pcm[:CHUNK * 3])
        await one.write_event(Describe().event())  # the sessions are admitted by now
        await until(one, "info")
        await two.write_event(Describe().event())
        await until(two, "info")
        await send_audio(three, pcm[:CHUNK])
        refused = await until(three, "error")
        assert refused[-1].data["code"] == "overloaded", refused
        assert "limit of 2" in refused[-1].data["text"]
        for wy in (one, two):
            await wy.write_event(AudioStop().event())
            assert (await until(wy, "transcript-stop", "error"))[-1].type == "transcript-stop"
    exposition = await asyncio.to_thread(get_text, stack.url + "/metrics")
    for outcome in ("done", "overloaded"):
        series = ('lanegate_protocol_sessions_total{lane="realtime",'
                  f'outcome="{outcome}",protocol="wyoming"}}')
        assert series in exposition, exposition


def test_with_api_keys_the_port_stays_closed(tmp_path: Path,
                                             redis_server: RedisServer) -> None:
    port = free_port()
    with lone_gateway(tmp_path, redis_server.url, LANEGATE_API_KEYS="k1",
                      LANEGATE_WYOMING_PORT=str(port)) as base:
        assert base.startswith("http://")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    log = (tmp_path / "gateway.log").read_text()
    assert "wyoming_off" in log


def test_the_banner_says_how_to_add_it_in_home_assistant() -> None:
    served = banner(Settings(), queued="none")
    assert "tcp://127.0.0.1:10300" in served
    assert ("Settings > Devices & services > Add integration > Wyoming Protocol, "
            "host 127.0.0.1, port 10300") in served
    assert "tcp://" not in banner(Settings(api_keys="k"), queued="none")
    assert "wyoming    off" in banner(Settings(wyoming_port=0), queued="none")


async def test_a_gateway_stopping_mid_transcription_sends_the_transcript_then_closes(
        tmp_path: Path, pcm: bytes) -> None:
    """SIGTERM while the audio flows: the transcription's audio ends, its last finals come
    as chunks, then ``transcript`` and ``transcript-stop``, then the connection closes
    (pocketsphinx: its words do not matter here, only the events)."""
    port = free_port()
    stack = await asyncio.to_thread(start_stack, tmp_path, batch=False,
                                    settings={"LANEGATE_WYOMING_PORT": str(port)})
    try:
        async with client(port) as wy:
            await send_audio(wy, pcm)
            await wy.write_event(Describe().event())  # the session is open by now
            await until(wy, "info")
            stack.procs["gateway"].signal(signal.SIGTERM)
            events = await until(wy, "transcript-stop", "error")
            assert [e.type for e in events][-2:] == ["transcript", "transcript-stop"], events
            assert Transcript.from_event(events[-2]).text, events
            assert await wy.read_event() is None  # closed after it
    finally:
        await asyncio.to_thread(stack.stop)
