"""``/v1/realtime?intent=transcription`` end to end: the official ``openai`` SDK, unchanged,
and a raw aiohttp WebSocket for every error path; real redis-server, gateway and
realtime worker subprocesses, real pocketsphinx, espeak-ng speech at 24 kHz and in
G.711 (encoded by sox, not by us)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from conftest import read_pcm
from openai import AsyncOpenAI
from phrases import SENTENCE_RECALL, TALKING, TRAFFIC, recall, spoken
from stack import Stack, start_stack

from bench.audio import SHARED_SPEECH
from gateway.audio_formats import AudioFormat

KEYS = ("alpha", "beta", "gamma", "delta")
MAX_FRAME = 96_000
#: how long a test waits for one event before it fails (not a latency assertion)
EVENT_WAIT_S = 30.0
APPEND_MS = 100
SETTINGS = {
    "LANEGATE_API_KEYS": ",".join(KEYS),
    "LANEGATE_MAX_SESSIONS_PER_KEY": "1",
    "LANEGATE_MAX_FRAME_BYTES": str(MAX_FRAME),
    "LANEGATE_IDLE_TIMEOUT_S": "5",
}
COMPLETED = "conversation.item.input_audio_transcription.completed"
DELTA = "conversation.item.input_audio_transcription.delta"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("realtime-api"), settings=SETTINGS, batch=False,
                    realtime_slots=3)
    try:
        yield s
    finally:
        s.stop()


def ws_url(stack: Stack, query: str = "intent=transcription") -> str:
    return stack.url.replace("http://", "ws://") + "/v1/realtime?" + query


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def silence(ms: int, rate: int) -> bytes:
    return bytes(rate * 2 * ms // 1000)


def g711(wav: Path, encoding: str) -> tuple[bytes, bytes]:
    """(G.711 bytes at 8 kHz encoded by sox, sox's own decoding of them to s16le)."""
    coded = subprocess.run(["sox", "-R", str(wav), "-r", "8000", "-c", "1", "-e", encoding,
                            "-t", "raw", "-"], check=True, capture_output=True).stdout
    decoded = subprocess.run(["sox", "-t", "raw", "-r", "8000", "-c", "1", "-e", encoding,
                              "-b", "8", "-", "-e", "signed", "-b", "16", "-t", "raw", "-"],
                             input=coded, check=True, capture_output=True).stdout
    return coded, decoded


# --- G.711 decoding ---------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "encoding"), [(AudioFormat.PCMU, "u-law"),
                                                (AudioFormat.PCMA, "a-law")])
def test_g711_decodes_as_sox_does(speech: Callable[..., Path], fmt: AudioFormat,
                                  encoding: str) -> None:
    coded, by_sox = g711(speech(TRAFFIC), encoding)
    ours = fmt.to_pcm(coded)
    assert len(ours) == 2 * len(coded)
    assert np.array_equal(np.frombuffer(ours, "<i2"), np.frombuffer(by_sox, "<i2"))


# --- the SDK ------------------------------------------------------------------------------
async def sdk_events(connection: Any, done: Callable[[list[Any]], bool]) -> list[Any]:
    events: list[Any] = []
    while not done(events):
        events.append(await asyncio.wait_for(connection.recv(), EVENT_WAIT_S))
    return events


def of(events: list[Any], kind: str) -> list[Any]:
    return [e for e in events if e.type == kind]


async def test_sdk_server_vad_streams_deltas_and_completed_transcripts(
        stack: Stack, speech: Callable[..., Path]) -> None:
    pcm, rate = read_pcm(speech(spoken(TRAFFIC, TALKING), rate=24000))
    pcm += silence(1500, rate)  # the VAD ends the last turn
    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="alpha")
    async with client.realtime.connect(model="lanegate",
                                       extra_query={"intent": "transcription"}) as conn:
        created = await asyncio.wait_for(conn.recv(), EVENT_WAIT_S)
        assert created.type == "session.created"
        assert created.session.type == "transcription"
        await conn.session.update(session={
            "type": "transcription",
            "audio": {"input": {
                "format": {"type": "audio/pcm", "rate": 24000},
                "transcription": {"model": "whisper-1", "language": "en"},
                "turn_detection": {"type": "server_vad", "threshold": 0.5,
                                   "prefix_padding_ms": 300, "silence_duration_ms": 500}}}})
        updated = await asyncio.wait_for(conn.recv(), EVENT_WAIT_S)
        assert updated.type == "session.updated", updated
        assert updated.session.audio.input.turn_detection.silence_duration_ms == 500
        step = rate * 2 * APPEND_MS // 1000

        async def send() -> None:
            for off in range(0, len(pcm), step):
                await conn.input_audio_buffer.append(
                    audio=base64.b64encode(pcm[off:off + step]).decode())
                await asyncio.sleep(APPEND_MS / 1000 / 4)

        sender = asyncio.create_task(send())
        events = await sdk_events(conn, lambda ev: len(of(ev, COMPLETED)) >= 2)
        await sender
    started = of(events, "input_audio_buffer.speech_started")
    stopped = of(events, "input_audio_buffer.speech_stopped")
    committed = of(events, "input_audio_buffer.committed")
    completed = of(events, COMPLETED)
    assert len(started) >= 2
    assert len(stopped) >= 2
    assert started[0].audio_start_ms < stopped[0].audio_end_ms <= started[1].audio_start_ms
    assert [c.item_id for c in committed[:2]] == [c.item_id for c in completed[:2]]
    assert committed[0].previous_item_id is None
    assert committed[1].previous_item_id == committed[0].item_id
    transcripts = [c.transcript for c in completed]
    assert recall(TRAFFIC, completed[0].transcript) >= SENTENCE_RECALL, transcripts
    assert recall(TALKING, completed[1].transcript) >= SENTENCE_RECALL, transcripts
    assert completed[0].usage.type == "duration"
    assert completed[0].usage.seconds > 1
    # the deltas of an item carry its words as they are decoded (the completed transcript
    # may still revise the last of them: it is the final hypothesis)
    first = "".join(d.delta for d in of(events, DELTA) if d.item_id == completed[0].item_id)
    assert recall(TRAFFIC, first) >= SENTENCE_RECALL
    assert events.index(of(events, DELTA)[0]) < events.index(completed[0])


async def test_sdk_client_commits_its_turns(stack: Stack, speech: Callable[..., Path]) -> None:
    # TRAFFIC: pocketsphinx's words for RAIN vary with how the turn is chunked
    pcm, rate = read_pcm(speech(TRAFFIC, rate=16000))
    pcm = silence(500, rate) + pcm + silence(300, rate)  # a speaker's pauses around a turn
    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="beta")
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        await asyncio.wait_for(conn.recv(), EVENT_WAIT_S)  # session.created
        await conn.session.update(session={
            "type": "transcription",
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": rate},
                                "turn_detection": None}}})
        updated = await asyncio.wait_for(conn.recv(), EVENT_WAIT_S)
        assert updated.type == "session.updated", updated
        assert updated.session.audio.input.turn_detection is None
        step = rate * 2 * APPEND_MS // 1000
        for _turn in range(2):  # the same sentence twice, each its own commit
            for off in range(0, len(pcm), step):
                await conn.input_audio_buffer.append(
                    audio=base64.b64encode(pcm[off:off + step]).decode())
            await conn.input_audio_buffer.commit()
        events = await sdk_events(conn, lambda ev: len(of(ev, COMPLETED)) == 2)
    assert not of(events, "input_audio_buffer.speech_started")  # no VAD events without VAD
    committed, completed = of(events, "input_audio_buffer.committed"), of(events, COMPLETED)
    assert events.index(committed[0]) < events.index(completed[0])
    assert [c.item_id for c in committed] == [c.item_id for c in completed]
    assert committed[1].previous_item_id == committed[0].item_id
    for done in completed:  # one item per commit, though the VAD would have cut earlier
        assert recall(TRAFFIC, done.transcript) >= SENTENCE_RECALL
        assert done.usage.seconds == pytest.approx(len(pcm) / 2 / rate, abs=0.05)


# --- raw WebSocket: the beta shape and every error path -------------------------------
class Raw:
    """A raw Realtime API client on an aiohttp WebSocket."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(event))

    async def recv(self) -> dict[str, Any]:
        msg = await self.ws.receive(timeout=EVENT_WAIT_S)
        assert msg.type is aiohttp.WSMsgType.TEXT, (msg.type, self.ws.close_code)
        event: dict[str, Any] = json.loads(msg.data)
        return event

    async def error(self) -> dict[str, Any]:
        event = await self.recv()
        assert event["type"] == "error", event
        assert set(event["error"]) == {"type", "code", "message", "param", "event_id"}
        return dict(event["error"])

    async def closed(self) -> int | None:
        msg = await self.ws.receive(timeout=EVENT_WAIT_S)
        assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), msg
        return self.ws.close_code


async def connect(http: aiohttp.ClientSession, stack: Stack, key: str = "gamma", *,
                  query: str = "intent=transcription",
                  headers: dict[str, str] | None = None) -> aiohttp.ClientWebSocketResponse:
    deadline = time.monotonic() + EVENT_WAIT_S
    while time.monotonic() < deadline:  # a previous test's lease goes a moment after close
        ws = await http.ws_connect(ws_url(stack, query), headers={**auth(key),
                                                                  **(headers or {})})
        first = await ws.receive(timeout=EVENT_WAIT_S)
        # a slot the previous test's session held is freed a moment after its close too
        if first.type is aiohttp.WSMsgType.TEXT and ("max_sessions_per_key" in first.data
                                                     or "no free decoder slot" in first.data):
            await ws.close()
            await asyncio.sleep(0.05)
            continue
        ws._first = first  # type: ignore[attr-defined]
        return ws
    raise AssertionError(f"the key's lease or a slot never went: {first.data}")


async def opened(http: aiohttp.ClientSession, stack: Stack, key: str = "gamma",
                 **kwargs: Any) -> Raw:
    ws = await connect(http, stack, key, **kwargs)
    created = json.loads(ws._first.data)  # type: ignore[attr-defined]
    assert created["type"] in ("session.created", "transcription_session.created"), created
    return Raw(ws)


def append(pcm: bytes) -> dict[str, Any]:
    return {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}


async def test_beta_shape_with_mulaw_and_client_commit(
        http: aiohttp.ClientSession, stack: Stack, speech: Callable[..., Path]) -> None:
    coded, _ = g711(speech(TRAFFIC), "u-law")
    raw = Raw(await connect(http, stack, headers={"OpenAI-Beta": "realtime=v1"}))
    created = json.loads(raw.ws._first.data)  # type: ignore[attr-defined]
    assert created["type"] == "transcription_session.created"
    assert created["session"]["input_audio_format"] == "pcm16"
    await raw.send({"type": "transcription_session.update", "session": {
        "input_audio_format": "g711_ulaw", "turn_detection": None,
        "input_audio_transcription": {"model": "whisper-1", "language": "en"}}})
    updated = await raw.recv()
    assert updated["type"] == "transcription_session.updated"
    assert updated["session"]["input_audio_format"] == "g711_ulaw"
    assert updated["session"]["turn_detection"] is None
    await raw.send(append(coded))
    await raw.send({"type": "input_audio_buffer.commit"})
    events = []
    while not events or events[-1]["type"] != COMPLETED:
        events.append(await raw.recv())
    assert events[0]["type"] in ("input_audio_buffer.committed", DELTA)
    assert events[-1]["usage"]["seconds"] == pytest.approx(len(coded) / 8000, abs=0.05)
    # 8 kHz audio lacks the band pocketsphinx's wideband model needs: it is recognised
    # poorly, "there it op erotic on the road are it" (4 of 11 words, the same in every
    # run since a session's words no longer depend on its steps' timing; they ranged
    # over 1-7 words before), so the limit is 0.15 below that
    assert events[-1]["transcript"].strip(), events[-1]
    assert recall(TRAFFIC, events[-1]["transcript"]) >= 2 / 11, events[-1]["transcript"]
    await raw.ws.close()


async def test_refusals_before_the_session(http: aiohttp.ClientSession, stack: Stack) -> None:
    async with http.get(f"{stack.url}/v1/realtime?intent=transcription",
                        headers=auth("gamma")) as resp:
        assert resp.status == 426
        assert (await resp.json())["error"]["code"] == "bad_request"
    async with http.ws_connect(ws_url(stack), headers=auth("nope")) as ws:
        raw = Raw(ws)
        assert (await raw.error())["code"] == "unauthorized"
        assert await raw.closed() == 1008
    async with http.ws_connect(ws_url(stack, "model=gpt-realtime"),
                               headers=auth("gamma")) as ws:
        raw = Raw(ws)
        err = await raw.error()
        assert err["code"] == "bad_request"
        assert "intent" in err["message"]
        assert err["type"] == "invalid_request_error"
        assert await raw.closed() == 1008


async def test_per_key_limit_and_full_slots_refuse_at_once(
        http: aiohttp.ClientSession, stack: Stack) -> None:
    held = [await opened(http, stack, key) for key in ("alpha", "beta", "gamma")]  # 3 slots
    for client in held:  # each waits idle_timeout_s from its last event: from now
        await client.send({"type": "session.update", "session": {"type": "transcription"}})
        assert (await client.recv())["type"] == "session.updated"
    async with http.ws_connect(ws_url(stack), headers=auth("alpha")) as ws:
        raw = Raw(ws)
        err = await raw.error()
        assert err["code"] == "overloaded"
        assert "max_sessions_per_key" in err["message"]
        assert await raw.closed() == 1013
    async with http.ws_connect(ws_url(stack), headers=auth("delta")) as ws:
        raw = Raw(ws)
        err = await raw.error()
        assert err["code"] == "overloaded"
        assert "no free decoder slot" in err["message"]
        assert err["type"] == "server_error"
        assert await raw.closed() == 1013
    for client in held:
        await client.ws.close()


async def test_bad_client_events_are_errors_and_the_session_goes_on(
        http: aiohttp.ClientSession, stack: Stack) -> None:
    raw = await opened(http, stack)
    bad_updates = [
        ({"type": "transcription", "audio": {"input": {"turn_detection":
                                                       {"type": "semantic_vad"}}}},
         "session.audio.input.turn_detection.type", "semantic_vad"),
        ({"type": "transcription", "audio": {"input": {"format": {"type": "audio/opus"}}}},
         "session.audio.input.format.type", "audio/opus"),
        ({"type": "transcription", "audio": {"input": {"format": {"type": "audio/pcm",
                                                                  "rate": 96000}}}},
         "session.audio.input.format.rate", "96000"),
        ({"type": "realtime"}, "session.type", "transcription"),
        ({"type": "transcription", "audio": {"input": {"turn_detection":
                                                       {"type": "server_vad",
                                                        "threshold": 2}}}},
         "session.audio.input.turn_detection.threshold", "threshold"),
    ]
    for session, param, word in bad_updates:
        await raw.send({"type": "session.update", "event_id": "ev1", "session": session})
        err = await raw.error()
        assert (err["code"], err["param"], err["event_id"]) == ("invalid_value", param, "ev1")
        assert word in err["message"]
    await raw.ws.send_str("not json")
    assert (await raw.error())["code"] == "bad_request"
    await raw.ws.send_bytes(b"\x00\x00")
    assert "input_audio_buffer.append" in (await raw.error())["message"]
    await raw.send({"type": "response.create"})
    assert (await raw.error())["param"] == "type"
    await raw.send({"type": "input_audio_buffer.commit", "event_id": "c1"})
    err = await raw.error()
    assert (err["code"], err["event_id"]) == ("input_audio_buffer_commit_empty", "c1")
    await raw.send({"type": "input_audio_buffer.append", "audio": "%%% not base64"})
    assert (await raw.error())["code"] == "invalid_value"
    await raw.send({"type": "input_audio_buffer.append"})
    assert (await raw.error())["code"] == "missing_required_parameter"
    await raw.send(append(b"\x01\x02\x03"))
    assert (await raw.error())["param"] == "audio"  # odd byte count
    await raw.send(append(bytes(MAX_FRAME + 2)))
    assert (await raw.error())["code"] == "too_large"
    await raw.send(append(silence(50, 24000)))
    await raw.send({"type": "input_audio_buffer.commit"})  # 50 ms: under 100 ms
    assert "50 ms" in (await raw.error())["message"]
    await raw.send({"type": "session.update", "session": {
        "type": "transcription", "audio": {"input": {"format": {"type": "audio/pcmu"}}}}})
    err = await raw.error()
    assert err["param"] == "session"
    assert "once audio has been sent" in err["message"]
    await raw.send({"type": "input_audio_buffer.clear"})
    assert (await raw.recv())["type"] == "input_audio_buffer.cleared"
    await raw.send({"type": "session.update", "session": {
        "type": "transcription", "audio": {"input": {"transcription": {"prompt": "hi"}}}}})
    updated = await raw.recv()
    assert updated["type"] == "session.updated"
    assert updated["session"]["audio"]["input"]["transcription"]["prompt"] == "hi"
    # the session still works: it answers a commit of enough audio
    await raw.send(append(silence(200, 24000)))
    await raw.send({"type": "input_audio_buffer.commit"})
    events = [await raw.recv()]
    while events[-1]["type"] != COMPLETED:
        events.append(await raw.recv())
    assert not [e for e in events if e["type"] == "error"], events
    await raw.ws.close()


# --- a lost gateway: the SDK's reconnect handler gets a new session -----------------------
@pytest.fixture
def own_stack(tmp_path: Path) -> Iterator[Stack]:
    """A stack of its own, with the default per-key limits: its gateway is stopped."""
    s = start_stack(tmp_path, settings={"LANEGATE_API_KEYS": "epsilon"}, batch=False)
    try:
        yield s
    finally:
        s.stop()


async def commit_turn(conn: Any, events: Any, pcm: bytes, rate: int) -> Any:
    """Configure the session for client commits, send one turn, commit: its transcript."""
    await conn.session.update(session={
        "type": "transcription",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": rate},
                            "turn_detection": None}}})
    step = rate * 2 * APPEND_MS // 1000
    for off in range(0, len(pcm), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[off:off + step]).decode())
    await conn.input_audio_buffer.commit()
    while True:
        event = await asyncio.wait_for(anext(events), EVENT_WAIT_S)
        assert event.type != "error", event
        if event.type == COMPLETED:
            return event


def restart_gateway(stack: Stack, sig: signal.Signals) -> None:
    gateway = stack.procs["gateway"]
    assert gateway.proc is not None
    gateway.proc.send_signal(sig)
    gateway.proc.wait(30)
    stack.spawn("gateway", "gateway")  # the orchestrator's restart, on the same address
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(stack.url + "/readyz", timeout=2):
                return
        except OSError:
            assert time.monotonic() < deadline, stack.diagnostics()
            time.sleep(0.1)


@pytest.mark.parametrize(("sig", "close_code"), [(signal.SIGTERM, 1001), (signal.SIGKILL, 1006)],
                         ids=["drained", "killed"])
async def test_sdk_reconnect_handler_gets_a_new_session_after_the_gateway_is_lost(
        own_stack: Stack, speech: Callable[..., Path], sig: signal.Signals,
        close_code: int) -> None:
    pcm, rate = read_pcm(speech(TRAFFIC, rate=16000))
    pcm = silence(500, rate) + pcm + silence(300, rate)
    reconnects: list[Any] = []
    client = AsyncOpenAI(base_url=f"{own_stack.url}/v1", api_key="epsilon")
    async with client.realtime.connect(extra_query={"intent": "transcription"},
                                       on_reconnecting=reconnects.append) as conn:
        events = conn.__aiter__()  # the SDK reconnects inside its event iterator
        first = await asyncio.wait_for(anext(events), EVENT_WAIT_S)
        assert first.type == "session.created"
        before = await commit_turn(conn, events, pcm, rate)
        await asyncio.to_thread(restart_gateway, own_stack, sig)
        # Until the killed gateway's heartbeat expires (gateway_lease_s), its session
        # still counts against the key: a retry may be refused "overloaded" (1013, which
        # the SDK retries too). Within the SDK's default retries it gets a new session.
        second = await asyncio.wait_for(anext(events), EVENT_WAIT_S)
        while second.type == "error":
            assert second.error.code == "overloaded", second
            second = await asyncio.wait_for(anext(events), EVENT_WAIT_S)
        assert second.type == "session.created", second  # a new session, on the new gateway
        assert second.session.id != first.session.id
        after = await commit_turn(conn, events, pcm, rate)
    # the close it saw is one the SDK's policy retries: a drain says "going away" (1001);
    # a killed gateway leaves a dropped connection (1006)
    assert reconnects
    assert reconnects[0].close_code == close_code
    assert reconnects[0].attempt == 1
    for turn in (before, after):
        assert recall(TRAFFIC, turn.transcript) >= SENTENCE_RECALL


# --- events in audio order: the shared human recording ------------------------------------


def resampled(wav: Path, rate: int) -> bytes:
    """``wav`` as PCM s16le mono at ``rate``, resampled by sox."""
    return subprocess.run(["sox", "-R", str(wav), "-r", str(rate), "-c", "1", "-e", "signed",
                           "-b", "16", "-t", "raw", "-"], check=True, capture_output=True).stdout


@pytest.fixture(scope="module")
def two_cities() -> tuple[bytes, str]:
    """The shared recording at 24 kHz and its transcript."""
    if not SHARED_SPEECH.exists():
        pytest.skip(f"{SHARED_SPEECH} (the shared human recording) is not on this machine")
    return resampled(SHARED_SPEECH, 24000), SHARED_SPEECH.with_suffix(".txt").read_text()


async def test_speech_started_and_stopped_alternate_in_audio_order(
        stack: Stack, two_cities: tuple[bytes, str]) -> None:
    """The VAD's events follow the audio: ``speech_started`` of the next turn never comes
    before ``speech_stopped`` of the current one (it did at three turn changes of this
    recording, the decoder's final lagging the VAD), and they alternate."""
    rate = 24000
    pcm = two_cities[0] + silence(1500, rate)  # the VAD ends the last turn
    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="delta")
    async with client.realtime.connect(model="lanegate",
                                       extra_query={"intent": "transcription"}) as conn:
        await asyncio.wait_for(conn.recv(), EVENT_WAIT_S)  # session.created
        await conn.session.update(session={
            "type": "transcription",
            "audio": {"input": {
                "format": {"type": "audio/pcm", "rate": rate},
                "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}}})
        assert (await asyncio.wait_for(conn.recv(), EVENT_WAIT_S)).type == "session.updated"
        step = rate * 2 * APPEND_MS // 1000

        async def send() -> None:  # at ten times real time: the decoder lags the VAD
            for off in range(0, len(pcm), step):
                await conn.input_audio_buffer.append(
                    audio=base64.b64encode(pcm[off:off + step]).decode())
                await asyncio.sleep(APPEND_MS / 1000 / 10)

        sender = asyncio.create_task(send())
        events: list[Any] = []

        def settled(ev: list[Any]) -> bool:  # every turn the VAD opened is completed
            return sender.done() and bool(of(ev, COMPLETED)) and len(of(
                ev, COMPLETED)) >= len(of(ev, "input_audio_buffer.speech_started"))

        deadline = time.monotonic() + 120
        while not settled(events):
            assert time.monotonic() < deadline, events
            with contextlib.suppress(TimeoutError):  # the sender may finish meanwhile
                events.append(await asyncio.wait_for(conn.recv(), 0.5))
        await sender
    assert not of(events, "error"), of(events, "error")
    vad = [e for e in events if e.type in ("input_audio_buffer.speech_started",
                                           "input_audio_buffer.speech_stopped")]
    kinds = [e.type.rsplit("_", 1)[1] for e in vad]
    assert len(kinds) >= 8, kinds  # the recording has many turns at 500 ms of silence
    assert kinds == ["started", "stopped"] * (len(kinds) // 2), kinds
    positions = [e.audio_start_ms if e.type.endswith("started") else e.audio_end_ms
                 for e in vad]
    assert positions == sorted(positions), positions
    for started, stopped in zip(vad[::2], vad[1::2], strict=True):
        assert started.item_id == stopped.item_id
    completed = of(events, COMPLETED)
    assert [c.item_id for c in completed] == [e.item_id for e in vad[::2]]
    assert recall(two_cities[1], " ".join(c.transcript for c in completed)) >= 0.6


# --- a silent session: its slot goes back, and it resumes at its next audio ---------------
SERVER_VAD = {"type": "server_vad", "silence_duration_ms": 500}
STARTED = "input_audio_buffer.speech_started"


async def configured(conn: Any, rate: int, turn_detection: dict[str, Any] | None) -> None:
    """``session.created``, then an update to ``rate`` and ``turn_detection``."""
    assert (await asyncio.wait_for(conn.recv(), EVENT_WAIT_S)).type == "session.created"
    await conn.session.update(session={"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": rate},
        "transcription": {"language": "en"}, "turn_detection": turn_detection}}})
    updated = await asyncio.wait_for(conn.recv(), EVENT_WAIT_S)
    assert updated.type == "session.updated", updated


async def say(conn: Any, pcm: bytes, rate: int, *, commit: bool = False) -> list[Any]:
    """Append ``pcm`` at four times real time (and commit it): the events up to the
    turn's ``completed``."""
    step = rate * 2 * APPEND_MS // 1000
    for off in range(0, len(pcm), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[off:off + step]).decode())
        await asyncio.sleep(APPEND_MS / 1000 / 4)
    if commit:
        await conn.input_audio_buffer.commit()
    events = await sdk_events(conn, lambda ev: bool(of(ev, COMPLETED)) or bool(of(ev, "error")))
    assert not of(events, "error"), of(events, "error")
    return events


def free_slots(stack: Stack) -> int:
    return sum(int(w["slots_free"]) for w in stack.live_workers().values())


async def wait_all_slots_free(stack: Stack) -> None:
    """Until every realtime slot is free (a silent session has parked), or fail."""
    deadline = time.monotonic() + EVENT_WAIT_S
    while await asyncio.to_thread(free_slots, stack) < 3:
        assert time.monotonic() < deadline, "a silent session kept its decoder slot"
        await asyncio.sleep(0.2)


def parked_sessions(stack: Stack) -> float:
    """The gateway's ``lanegate_parked_sessions`` gauge."""
    with urllib.request.urlopen(stack.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lanegate_parked_sessions{"))


async def wait_parked(stack: Stack, n: int) -> None:
    """Until the gateway counts ``n`` parked sessions, or fail."""
    deadline = time.monotonic() + EVENT_WAIT_S
    while (got := await asyncio.to_thread(parked_sessions, stack)) != n:
        assert time.monotonic() < deadline, f"{got} parked sessions, not {n}"
        await asyncio.sleep(0.2)


async def hold_every_slot(http: aiohttp.ClientSession, stack: Stack,
                          keys: tuple[str, ...]) -> list[aiohttp.ClientWebSocketResponse]:
    """A ``/v1/stream`` of each key (such a stream does not park: it holds its slot
    until ``idle_timeout_s``), each ``ready``: every slot taken."""
    url = stack.url.replace("http://", "ws://") + "/v1/stream?sample_rate=16000"
    streams = []
    for key in keys:
        ws = await http.ws_connect(url, headers=auth(key))
        ready = json.loads((await ws.receive(timeout=EVENT_WAIT_S)).data)
        assert ready["type"] == "ready", ready
        streams.append(ws)
    return streams


@pytest.mark.parametrize("turn_detection", [SERVER_VAD, None], ids=["server_vad", "commits"])
async def test_a_silent_session_gives_its_slot_back_and_resumes_at_its_next_audio(
        http: aiohttp.ClientSession, stack: Stack, speech: Callable[..., Path],
        turn_detection: dict[str, Any] | None) -> None:
    rate = 24000
    commit = turn_detection is None
    first, _ = read_pcm(speech(TRAFFIC, rate=rate))
    second, _ = read_pcm(speech(TALKING, rate=rate))
    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="alpha")
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        await configured(conn, rate, turn_detection)
        await wait_all_slots_free(stack)  # no slot before its first audio either
        await wait_parked(stack, 1)
        before = await say(conn, first + silence(1000, rate), rate, commit=commit)
        # silent now: after realtime_park_after_s its slot goes back, and other keys'
        # streams take every slot while it stays connected
        await wait_all_slots_free(stack)
        await wait_parked(stack, 1)
        for ws in await hold_every_slot(http, stack, ("beta", "gamma", "delta")):
            await ws.close()
        after = await say(conn, second + silence(1000, rate), rate, commit=commit)
    await wait_parked(stack, 0)
    done_before, done_after = of(before, COMPLETED)[0], of(after, COMPLETED)[0]
    assert recall(TRAFFIC, done_before.transcript) >= SENTENCE_RECALL, done_before.transcript
    assert recall(TALKING, done_after.transcript) >= SENTENCE_RECALL, done_after.transcript
    # the session goes on where it was: the next item follows the first, and the
    # audio's times count from the session's first audio
    assert of(after, "input_audio_buffer.committed")[0].previous_item_id == \
        done_before.item_id
    if not commit:
        assert of(after, STARTED)[0].audio_start_ms >= (len(first) // 2 + rate) * 1000 // rate


async def test_a_session_whose_audio_stops_mid_speech_gets_its_transcript_and_parks(
        http: aiohttp.ClientSession, stack: Stack, speech: Callable[..., Path]) -> None:
    """No more audio in the middle of a word: the VAD's segment stays open, so the
    session keeps its slot for ``idle_timeout_s`` (5 s here) in case the speech goes
    on, then parks all the same: the open turn is stopped and completed, the slot goes
    back, and the next audio resumes the session."""
    rate = 24000
    pcm, _ = read_pcm(speech(TRAFFIC, rate=rate))
    cut = pcm[:len(pcm) - rate * 2 * 6 // 10]  # espeak ends in 450 ms of silence: mid-word
    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="alpha")
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        await configured(conn, rate, SERVER_VAD)
        events = await say(conn, cut, rate)  # returns at the turn's completed
        await wait_all_slots_free(stack)
        after = await say(conn, pcm + silence(1000, rate), rate)
    kinds = [e.type for e in events if e.type.startswith("input_audio_buffer.speech")]
    assert kinds == [STARTED, "input_audio_buffer.speech_stopped"], kinds
    assert recall(TRAFFIC, of(events, COMPLETED)[0].transcript) >= SENTENCE_RECALL
    assert recall(TRAFFIC, of(after, COMPLETED)[0].transcript) >= SENTENCE_RECALL


async def test_a_parked_session_without_a_free_slot_at_its_next_audio_is_overloaded(
        http: aiohttp.ClientSession, stack: Stack) -> None:
    raw = await opened(http, stack, "alpha")
    await raw.send(append(silence(300, 24000)))
    await raw.send({"type": "input_audio_buffer.commit"})
    while (await raw.recv())["type"] != COMPLETED:
        pass
    await wait_all_slots_free(stack)
    streams = await hold_every_slot(http, stack, ("beta", "gamma", "delta"))
    await raw.send(append(silence(300, 24000)))  # resuming needs a slot, as a new session
    err = await raw.error()
    assert err["code"] == "overloaded", err
    assert await raw.closed() == 1013
    for ws in streams:
        await ws.close()
    # their slots come back when each worker has seen its stream close, not at close():
    # the next test found all three still held once (CI on a slow VM, "overloaded")
    await wait_all_slots_free(stack)


@pytest.mark.slow
async def test_sdk_sessions_keep_working_after_40_s_of_silence(
        stack: Stack, speech: Callable[..., Path]) -> None:
    """The issue's case, with the Realtime defaults: 40 s without an append (a voice
    agent while its bot talks, a push-to-talk client between turns) no longer closes the
    session (it did at 30 s), for turn detection and for client commits alike."""
    rate = 24000
    first, _ = read_pcm(speech(TRAFFIC, rate=rate))
    second, _ = read_pcm(speech(TALKING, rate=rate))

    async def session(key: str, turn_detection: dict[str, Any] | None) -> list[str]:
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key=key)
        commit = turn_detection is None
        transcripts = []
        async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await configured(conn, rate, turn_detection)
            for turn, pcm in enumerate((first, second)):
                if turn:
                    await asyncio.sleep(40)  # nothing sent, nothing received
                events = await say(conn, pcm + silence(1000, rate), rate, commit=commit)
                transcripts.append(of(events, COMPLETED)[0].transcript)
        return transcripts

    for transcripts in await asyncio.gather(session("alpha", SERVER_VAD),
                                            session("beta", None)):
        assert recall(TRAFFIC, transcripts[0]) >= SENTENCE_RECALL, transcripts
        assert recall(TALKING, transcripts[1]) >= SENTENCE_RECALL, transcripts
