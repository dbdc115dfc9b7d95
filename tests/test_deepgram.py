"""Deepgram's ``/v1/listen`` end to end: the real ``deepgram-sdk`` (live and prerecorded,
unchanged but for its base URL), pipecat-ai's ``DeepgramSTTService`` in a pipeline, and
raw aiohttp for every error path; real redis-server, gateway, realtime and batch worker
subprocesses, real pocketsphinx, espeak-ng speech (two voices for a stereo call)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web
from conftest import read_pcm, synthesize
from deepgram import AsyncDeepgramClient, DeepgramClientEnvironment
from deepgram.core.api_error import ApiError
from phrases import MOST, RAIN, SENTENCE_RECALL, TALKING, TRAFFIC, recall, spoken
from stack import Stack, start_stack

from lanegate.supervisor import free_port
from lanegate.webhooks import verify_signature

pytestmark = pytest.mark.slow

KEYS = ("alpha", "beta", "gamma")
SECRET = "whsec-deepgram"
SETTINGS = {
    "LANEGATE_API_KEYS": ",".join(KEYS),
    "LANEGATE_IDLE_TIMEOUT_S": "10",  # Deepgram's own: no audio or KeepAlive for 10 s
    "LANEGATE_WEBHOOK_SECRET": SECRET,
    "LANEGATE_WEBHOOK_ALLOW_PRIVATE": "true",  # the receiver is on loopback
    "LANEGATE_UPLOAD_RESERVE_SLOTS": "0",
}
#: how long a test waits for one message before it fails (not a latency assertion)
WAIT_S = 30.0
RATE = 16000
FRAME_MS = 100
#: the second voice of the stereo call (the first is the fixture's en-us+klatt): of eight
#: espeak-ng voices tried, the one pocketsphinx hears as well (RAIN at recall 1.0 alone)
OTHER_VOICE = "en-us+klatt2"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("deepgram"), settings=SETTINGS, realtime_slots=4)
    try:
        yield s
    finally:
        s.stop()


def client(stack: Stack, key: str = "alpha") -> AsyncDeepgramClient:
    ws = stack.url.replace("http://", "ws://")
    return AsyncDeepgramClient(api_key=key, environment=DeepgramClientEnvironment(
        base=stack.url, production=ws, agent=ws, agent_rest=stack.url))


def ws_url(stack: Stack, query: str) -> str:
    return stack.url.replace("http://", "ws://") + "/v1/listen?" + query


def silence(ms: int, rate: int = RATE, channels: int = 1) -> bytes:
    return bytes(rate * 2 * channels * ms // 1000)


def frames(pcm: bytes, ms: int = FRAME_MS, rate: int = RATE, channels: int = 1) -> list[bytes]:
    step = rate * 2 * channels * ms // 1000
    return [pcm[i:i + step] for i in range(0, len(pcm), step)]


class Live:
    """A live SDK connection's messages as they come, in a background task."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.messages: list[Any] = []
        self.grew = asyncio.Event()
        self.task = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        async for message in self.conn:
            self.messages.append(message)
            self.grew.set()

    async def until(self, done: Callable[[list[Any]], bool], wait_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + wait_s
        while not done(self.messages):
            self.grew.clear()
            left = deadline - time.monotonic()
            if left <= 0 or self.task.done():
                raise AssertionError(f"not there after {wait_s} s: {self.messages[-5:]}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.grew.wait(), left)

    def of(self, kind: str) -> list[Any]:
        return [m for m in self.messages if getattr(m, "type", None) == kind]

    def finals(self) -> list[Any]:
        return [m for m in self.of("Results") if m.is_final]

    def text(self, channel: int = 0) -> str:
        return " ".join(m.channel.alternatives[0].transcript for m in self.finals()
                        if m.channel_index[0] == channel)


def trimmed(pcm: bytes) -> bytes:
    """``pcm`` without its trailing silence (espeak-ng ends a clip with some)."""
    samples = np.frombuffer(pcm, "<i2")
    loud = np.flatnonzero(np.abs(samples) > 300)
    return samples[:loud[-1] + 1].tobytes() if loud.size else pcm


async def send_paced(conn: Any, pcm: bytes, channels: int = 1) -> None:
    """Send in 100 ms frames, at about five times real time."""
    for frame in frames(pcm, channels=channels):
        await conn.send_media(frame)
        await asyncio.sleep(FRAME_MS / 5000)


# --- the SDK, live -----------------------------------------------------------------------
async def test_sdk_live_interim_keepalive_finalize_closestream(
        stack: Stack, speech: Callable[..., Path]) -> None:
    first, _ = read_pcm(speech(TALKING))
    second, _ = read_pcm(speech(TRAFFIC))
    second = silence(500) + trimmed(second)  # no trailing silence: only Finalize ends it
    async with client(stack).listen.v1.connect(
            model="nova-3", encoding="linear16", sample_rate="16000", interim_results="true",
            vad_events="true", utterance_end_ms="1000", punctuate="true",
            smart_format="true", language="en") as conn:
        live = Live(conn)
        await send_paced(conn, first + silence(2000))
        await live.until(lambda m: any(r.speech_final for r in live.finals()))
        await live.until(lambda m: bool(live.of("UtteranceEnd")))

        interim = [r for r in live.of("Results") if not r.is_final]
        assert interim
        assert interim[0].channel.alternatives[0].transcript
        assert live.of("SpeechStarted")
        final = live.finals()[0]
        assert final.channel_index == [0, 1]
        assert final.speech_final
        assert not final.from_finalize
        alt = final.channel.alternatives[0]
        assert recall(TALKING, alt.transcript) >= SENTENCE_RECALL, alt.transcript
        assert alt.words
        assert 0 < alt.confidence <= 1
        for word in alt.words:
            assert word.punctuated_word
            assert word.word == word.word.lower()
            assert final.start - 0.01 <= word.start <= word.end
            assert word.end <= final.start + final.duration + 0.01
        assert live.of("UtteranceEnd")[0].last_word_end == pytest.approx(alt.words[-1].end)

        # 36 s of KeepAlive only, every 5 s as Pipecat sends it (idle_timeout_s is 10 s)
        before = len(live.messages)
        for _ in range(8):
            await asyncio.sleep(4.5)
            await conn.send_keep_alive()
        assert not live.task.done(), "the connection closed during the KeepAlive stretch"
        workers = await asyncio.to_thread(stack.live_workers)  # silent: parked, no slot held
        assert all(w["slots_free"] == w["slots_total"] for w in workers.values()), workers
        assert all(getattr(m, "type", None) != "Error" for m in live.messages[before:])

        # speech with no trailing silence for an endpoint: Finalize ends it
        await send_paced(conn, second)
        await conn.send_finalize()
        await live.until(lambda m: any(r.from_finalize for r in live.finals()))
        flushed = [r for r in live.finals() if r.from_finalize]
        assert not flushed[0].speech_final
        assert recall(TRAFFIC, " ".join(r.channel.alternatives[0].transcript
                                        for r in flushed)) >= SENTENCE_RECALL

        await conn.send_close_stream()
        await live.until(lambda m: bool(live.of("Metadata")))
        await asyncio.wait_for(live.task, WAIT_S)
    meta = live.of("Metadata")[0]
    assert meta.channels == 1
    sent = first + silence(2000) + second
    assert meta.duration == pytest.approx(len(sent) / 2 / RATE, abs=0.01)
    assert meta.sha256 == hashlib.sha256(sent).hexdigest()
    assert live.messages[-1].type == "Metadata"
    assert conn._websocket.close_code == 1000


async def test_without_keepalive_the_stream_ends_net_0001(stack: Stack,
                                                          http: aiohttp.ClientSession) -> None:
    async with http.ws_connect(ws_url(stack, "encoding=linear16&sample_rate=16000"),
                               headers={"Authorization": "Token beta"}) as ws:
        await ws.send_bytes(silence(500))
        began = time.monotonic()
        msg = await ws.receive(timeout=WAIT_S)
        error = json.loads(msg.data)
        assert error["type"] == "Error"
        assert error["variant"] == "NET-0001"
        assert "idle_timeout_s" in error["description"]
        assert time.monotonic() - began >= 9.0
        closed = await ws.receive(timeout=WAIT_S)
        assert closed.type is aiohttp.WSMsgType.CLOSE
        assert ws.close_code == 1011


# --- multichannel ------------------------------------------------------------------------
async def test_stereo_call_each_channel_gets_its_own_words(
        stack: Stack, speech: Callable[..., Path], tmp_path: Path) -> None:
    agent, _ = read_pcm(speech(TRAFFIC))
    customer, _ = read_pcm(synthesize(RAIN, tmp_path / "customer.wav", voice=OTHER_VOICE))
    # the agent speaks, then the customer answers while the agent's line is silent
    left = np.frombuffer(agent + silence(1000) + bytes(len(customer)) + silence(1500), "<i2")
    right = np.frombuffer(bytes(len(agent)) + silence(1000) + customer + silence(1500), "<i2")
    stereo = np.stack([left, right], axis=1).astype("<i2").tobytes()
    async with client(stack, "gamma").listen.v1.connect(
            model="nova-3", encoding="linear16", sample_rate="16000", channels="2",
            multichannel="true") as conn:
        live = Live(conn)
        await send_paced(conn, stereo, channels=2)
        await conn.send_close_stream()
        await live.until(lambda m: bool(live.of("Metadata")))
    assert {tuple(r.channel_index) for r in live.finals()} == {(0, 2), (1, 2)}
    agent_text, customer_text = live.text(0), live.text(1)
    assert recall(TRAFFIC, agent_text) >= SENTENCE_RECALL, agent_text
    assert recall(RAIN, customer_text) >= SENTENCE_RECALL, customer_text
    assert recall(RAIN, agent_text) < MOST
    assert recall(TRAFFIC, customer_text) < MOST
    assert live.of("Metadata")[0].channels == 2


# --- prerecorded -------------------------------------------------------------------------
async def test_sdk_prerecorded(stack: Stack, speech: Callable[..., Path]) -> None:
    audio = speech(spoken(TRAFFIC, TALKING)).read_bytes()
    response = await client(stack).listen.v1.media.transcribe_file(
        request=audio, model="nova-3", punctuate=True, smart_format=True, language="en")
    alt = response.results.channels[0].alternatives[0]
    assert recall(spoken(TRAFFIC, TALKING), alt.transcript) >= MOST, alt.transcript
    assert alt.words
    assert all(w.start <= w.end for w in alt.words)
    assert response.metadata.channels == 1
    assert response.metadata.duration == pytest.approx(len(read_pcm(
        speech(spoken(TRAFFIC, TALKING)))[0]) / 2 / RATE, abs=0.05)


@pytest_asyncio.fixture
async def receiver() -> AsyncIterator[tuple[str, asyncio.Queue[tuple[dict[str, str], bytes]]]]:
    """A webhook receiver on loopback: its URL and the deliveries it got."""
    got: asyncio.Queue[tuple[dict[str, str], bytes]] = asyncio.Queue()

    async def hook(request: web.Request) -> web.Response:
        await got.put((dict(request.headers), await request.read()))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}/hook", got
    await runner.cleanup()


async def test_sdk_callback_job_posts_deepgrams_response(
        stack: Stack, speech: Callable[..., Path],
        receiver: tuple[str, asyncio.Queue[tuple[dict[str, str], bytes]]]) -> None:
    url, got = receiver
    audio = speech(spoken(TRAFFIC, TALKING)).read_bytes()
    accepted = await client(stack).listen.v1.media.transcribe_file(
        request=audio, model="nova-3", callback=url)
    assert accepted.request_id
    headers, body = await asyncio.wait_for(got.get(), 120)
    assert verify_signature(SECRET, headers["X-Lanegate-Signature"], body)
    result = json.loads(body)
    assert result["metadata"]["request_id"] == accepted.request_id
    transcript = result["results"]["channels"][0]["alternatives"][0]["transcript"]
    assert recall(spoken(TRAFFIC, TALKING), transcript) >= MOST, transcript


async def test_json_body_with_url_is_refused(stack: Stack, http: aiohttp.ClientSession) -> None:
    async with http.post(stack.url + "/v1/listen", json={"url": "https://example.com/a.wav"},
                         headers={"Authorization": "Token alpha"}) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["err_code"] == "Bad Request"
    assert "URL" in body["err_msg"]
    assert body["request_id"]


# --- pipecat -----------------------------------------------------------------------------
async def test_pipecat_deepgram_stt_service_turns_audio_into_transcriptions(
        stack: Stack, speech: Callable[..., Path]) -> None:
    from pipecat.frames.frames import EndFrame, Frame, InputAudioRawFrame, TranscriptionFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.deepgram.stt import DeepgramSTTService
    from pipecat.workers.runner import WorkerRunner

    texts: list[str] = []
    heard = asyncio.Event()

    class Collect(FrameProcessor):
        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, TranscriptionFrame):
                texts.append(frame.text)
                if recall(TRAFFIC, " ".join(texts)) >= SENTENCE_RECALL:
                    heard.set()
            await self.push_frame(frame, direction)

    stt = DeepgramSTTService(api_key="alpha", base_url=stack.url.replace("http://", "ws://"),
                             sample_rate=RATE)
    worker = PipelineWorker(Pipeline([stt, Collect()]), cancel_on_idle_timeout=False,
                            params=PipelineParams(audio_in_sample_rate=RATE))
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _started(worker: Any, frame: Any) -> None:
        started.set()

    pcm, _ = read_pcm(speech(TRAFFIC))

    async def feed() -> None:
        await asyncio.wait_for(started.wait(), WAIT_S)
        for chunk in frames(pcm + silence(2000), ms=20):
            await worker.queue_frame(InputAudioRawFrame(audio=chunk, sample_rate=RATE,
                                                        num_channels=1))
            await asyncio.sleep(0.004)
        try:
            await asyncio.wait_for(heard.wait(), WAIT_S)
        finally:
            await worker.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await asyncio.wait_for(asyncio.gather(runner.run(), feed()), 2 * WAIT_S)
    assert recall(TRAFFIC, " ".join(texts)) >= SENTENCE_RECALL, texts


# --- auth --------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["bearer", "subprotocol", "query"])
async def test_each_way_of_presenting_the_key(stack: Stack, http: aiohttp.ClientSession,
                                              how: str) -> None:
    query = "encoding=linear16&sample_rate=16000"
    kwargs: dict[str, Any] = {}
    if how == "bearer":
        kwargs["headers"] = {"Authorization": "Bearer beta"}
    elif how == "subprotocol":  # what a browser sends: it cannot set headers
        kwargs["protocols"] = ("token", "beta")
    else:
        query += "&api_key=beta"
    async with http.ws_connect(ws_url(stack, query), **kwargs) as ws:
        if how == "subprotocol":
            assert ws.protocol == "token"
        await ws.send_json({"type": "CloseStream"})
        meta = json.loads((await ws.receive(timeout=WAIT_S)).data)
        assert meta["type"] == "Metadata"
        await ws.receive(timeout=WAIT_S)
    assert ws.close_code == 1000


async def test_a_missing_or_wrong_key_is_refused_at_the_handshake(stack: Stack) -> None:
    with pytest.raises(ApiError) as refused:
        async with client(stack, "not-a-key").listen.v1.connect(
                model="nova-3", encoding="linear16", sample_rate="16000"):
            pass
    assert refused.value.status_code == 401
    status, headers, body = await handshake(stack, "encoding=linear16&sample_rate=16000")
    assert status == 401
    assert body["err_code"] == "INVALID_AUTH"
    assert headers["dg-request-id"] == body["request_id"]


# --- bad input: Deepgram's errors, and another live session undisturbed --------------------
UPGRADE = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
           "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}


async def handshake(stack: Stack, query: str, key: str | None = None
                    ) -> tuple[int, dict[str, str], dict[str, Any]]:
    """A WebSocket upgrade request that is refused: its status, headers and body."""
    headers = dict(UPGRADE)
    if key is not None:
        headers["Authorization"] = f"Token {key}"
    async with aiohttp.ClientSession() as http, \
            http.get(stack.url + "/v1/listen?" + query, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def refused_query(stack: Stack, query: str) -> str:
    """The SDK's refusal and the handshake's Deepgram error of ``query``: its message."""
    status, headers, body = await handshake(stack, query, key="beta")
    assert status == 400
    assert body["err_code"] == "Bad Request"
    assert headers["dg-error"] == body["err_msg"]
    return str(body["err_msg"])


async def error_then_close(ws: aiohttp.ClientWebSocketResponse) -> tuple[dict[str, Any], int]:
    error = json.loads((await ws.receive(timeout=WAIT_S)).data)
    closed = await ws.receive(timeout=WAIT_S)
    assert closed.type is aiohttp.WSMsgType.CLOSE
    return error, int(ws.close_code or 0)


async def test_bad_input_gets_deepgrams_errors_and_takes_nothing_from_a_live_session(
        stack: Stack, speech: Callable[..., Path], http: aiohttp.ClientSession) -> None:
    pcm, _ = read_pcm(speech(TRAFFIC))
    async with client(stack, "alpha").listen.v1.connect(
            model="nova-3", encoding="linear16", sample_rate="16000") as conn:
        live = Live(conn)

        async def stream() -> None:  # in real time, while the bad clients come and go
            for frame in frames(pcm + silence(2000)):
                await conn.send_media(frame)
                await asyncio.sleep(FRAME_MS / 1000)

        streaming = asyncio.create_task(stream())

        with pytest.raises(ApiError) as refused:  # what the SDK's user sees
            async with client(stack, "beta").listen.v1.connect(
                    model="nova-3", encoding="opus", sample_rate="16000"):
                pass
        assert refused.value.status_code == 400
        assert "opus" in await refused_query(stack, "encoding=opus&sample_rate=16000")
        assert "diariz" in await refused_query(
            stack, "encoding=linear16&sample_rate=16000&diarize=true")
        assert "redact" in await refused_query(
            stack, "encoding=linear16&sample_rate=16000&redact=pci")
        assert "max_stream_channels" in await refused_query(
            stack, "encoding=linear16&sample_rate=16000&channels=99")
        assert "sample_rate" in await refused_query(stack, "encoding=mulaw")

        # a frame that is not whole samples of the declared channels
        three = ws_url(stack, "encoding=linear16&sample_rate=16000&channels=3")
        async with http.ws_connect(three, headers={"Authorization": "Token beta"}) as ws:
            await ws.send_bytes(silence(100))  # 3200 bytes: not whole 6-byte samples
            error, code = await error_then_close(ws)
        assert (error["type"], error["variant"], code) == ("Error", "DATA-0000", 1008)
        assert "3 channel" in error["description"]

        # a bogus control message, a Configure, and a 1 MB text frame: answered, and the
        # stream goes on to its Metadata
        mono = ws_url(stack, "encoding=linear16&sample_rate=16000")
        async with http.ws_connect(mono, headers={"Authorization": "Token beta"}) as ws:
            await ws.send_json({"type": "Nonsense"})
            bogus = json.loads((await ws.receive(timeout=WAIT_S)).data)
            await ws.send_json({"type": "Configure", "keyterms": ["lanegate"]})
            configure = json.loads((await ws.receive(timeout=WAIT_S)).data)
            await ws.send_str("x" * 1_000_000)
            huge = json.loads((await ws.receive(timeout=WAIT_S)).data)
            await ws.send_bytes(silence(500))
            await ws.send_json({"type": "CloseStream"})
            meta = json.loads((await ws.receive(timeout=WAIT_S)).data)
            await ws.receive(timeout=WAIT_S)
        assert (bogus["type"], bogus["variant"]) == ("Error", "SchemaError")
        assert bogus["message"] == '{"type": "Nonsense"}'
        assert configure["type"] == "ConfigureFailure"
        assert (huge["type"], huge["variant"]) == ("Error", "SchemaError")
        assert len(huge["message"]) <= 200
        assert meta["type"] == "Metadata"
        assert meta["duration"] == pytest.approx(0.5)
        assert ws.close_code == 1000

        await streaming
        await live.until(lambda m: any(r.speech_final for r in live.finals()))
    assert recall(TRAFFIC, live.text()) >= SENTENCE_RECALL, live.text()
    assert not live.of("Error")


def mulaw(wav: Path) -> bytes:
    """``wav`` as G.711 mu-law at its own rate, encoded by sox."""
    return subprocess.run(["sox", "-R", str(wav), "-e", "u-law", "-t", "raw", "-"],
                          check=True, capture_output=True).stdout


async def test_mulaw_live_stream(stack: Stack, speech: Callable[..., Path]) -> None:
    coded = await asyncio.to_thread(mulaw, speech(TRAFFIC))
    async with client(stack, "beta").listen.v1.connect(
            model="nova-3", encoding="mulaw", sample_rate="16000") as conn:
        live = Live(conn)
        for off in range(0, len(coded), 1600):  # 100 ms frames
            await conn.send_media(coded[off:off + 1600])
            await asyncio.sleep(0.02)
        await conn.send_close_stream()
        await live.until(lambda m: bool(live.of("Metadata")))
    assert recall(TRAFFIC, live.text()) >= SENTENCE_RECALL, live.text()
    assert live.of("Metadata")[0].duration == pytest.approx(len(coded) / RATE, abs=0.01)
