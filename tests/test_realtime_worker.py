"""The realtime worker over its internal WebSocket: real Redis, real pocketsphinx,
real espeak-ng speech, a real aiohttp client; SIGTERM drain on a real subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from conftest import RedisServer, read_pcm
from phrases import SENTENCE_RECALL, TALKING, TRAFFIC, recall
from prometheus_client import REGISTRY
from wsrun import Run

from engines import Engine
from engines.pocketsphinx import PocketsphinxEngine
from engines.simulated import SimulatedEngine
from gateway.links import WorkerLinks
from lanegate.blobs import new_id
from lanegate.constants import INTERNAL_TOKEN_HEADER, LINK_PATH
from lanegate.settings import Settings
from lanes import registry
from lanes.jobs import JobStore
from workers.realtime import SESSION_PATH, RealtimeWorker

ONE = TRAFFIC
TWO = TALKING
FRAME_MS = 100


@pytest.fixture(scope="module")
def ps_engine() -> PocketsphinxEngine:
    return PocketsphinxEngine(Settings(), slots=2, batch_decoder=False)


def ws_url(worker: RealtimeWorker, session_id: str, rate: int = 16000) -> str:
    return f"{worker.url}{SESSION_PATH}?session_id={session_id}&sample_rate={rate}&language=en"


async def stream(url: str, pcm: bytes, rate: int, *, pace_s: float = 0.02,
                 silence_s: float = 1.0) -> Run:
    """Send ``pcm`` in 100 ms frames (faster than real time), then silence, then end."""
    run = Run()
    frame = rate * FRAME_MS // 1000 * 2
    audio = pcm + bytes(int(silence_s * rate) * 2)
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        accepted = await ws.receive_json(timeout=10)
        assert accepted["type"] == "accepted", accepted

        async def read() -> None:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    run.events.append(json.loads(msg.data))

        reader = asyncio.create_task(read())
        for off in range(0, len(audio), frame):
            await ws.send_bytes(audio[off : off + frame])
            await asyncio.sleep(pace_s)
        run.partials_before_end = len(run.of("partial"))
        await ws.send_str(json.dumps({"type": "end"}))
        await asyncio.wait_for(reader, 30)
        run.close_code = ws.close_code
    return run


@pytest_asyncio.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def start_worker(redis_client: aioredis.Redis, engine: Engine, **changes: Any
                       ) -> RealtimeWorker:
    settings = Settings(worker_id="rt-test", heartbeat_s=0.2).replace(**changes)
    worker = RealtimeWorker(settings, engine, redis_client, lane=changes.get("lane_", "realtime"))
    await worker.start()
    return worker


@pytest_asyncio.fixture
async def worker(redis_client: aioredis.Redis, ps_engine: PocketsphinxEngine
                 ) -> AsyncIterator[RealtimeWorker]:
    w = await start_worker(redis_client, ps_engine)
    yield w
    await w.stop()


@pytest.mark.parametrize("rate", [16000, 44100])
async def test_speech_gives_partials_while_sending_and_finals_with_the_words(
    worker: RealtimeWorker, speech: Callable[..., Path], rate: int,
) -> None:
    pcm, got = read_pcm(speech(ONE, rate=rate))
    assert got == rate
    run = await stream(ws_url(worker, "s1", rate), pcm, rate)
    assert run.partials_before_end > 0, "partials arrive while audio is still being sent"
    assert run.events[-1] == {"type": "done"}
    assert run.close_code == 1000
    finals = run.of("final")
    assert [f["segment"] for f in finals] == list(range(len(finals)))
    assert recall(ONE, run.final_text) >= SENTENCE_RECALL, run.final_text
    first = finals[0]
    assert first["cut"] == "endpoint"
    assert 0 <= first["start_ms"] < first["end_ms"] <= first["audio_end_ms"]
    assert [w["word"] for w in first["words"]] == first["text"].split()
    assert all(first["start_ms"] / 1000 - 0.3 <= w["start"] < w["end"]
               <= first["end_ms"] / 1000 + 0.3 for w in first["words"]), first
    ends = [p["audio_end_ms"] for p in run.of("partial")]
    assert ends == sorted(ends)


async def test_two_concurrent_sessions_get_their_own_text(
    worker: RealtimeWorker, speech: Callable[..., Path],
) -> None:
    one, _ = read_pcm(speech(ONE))
    two, _ = read_pcm(speech(TWO))
    a, b = await asyncio.gather(stream(ws_url(worker, "a"), one, 16000),
                                stream(ws_url(worker, "b"), two, 16000))
    assert recall(ONE, a.final_text) > recall(ONE, b.final_text)
    assert recall(TWO, b.final_text) > recall(TWO, a.final_text)
    assert recall(ONE, a.final_text) >= SENTENCE_RECALL
    assert recall(TWO, b.final_text) >= SENTENCE_RECALL


async def test_a_full_worker_refuses_at_once_with_overloaded(
    worker: RealtimeWorker, redis_client: aioredis.Redis,
) -> None:
    async with aiohttp.ClientSession() as http:
        held = [await http.ws_connect(ws_url(worker, f"h{i}")) for i in range(2)]
        for ws in held:
            assert (await ws.receive_json(timeout=5))["type"] == "accepted"
        async with http.ws_connect(ws_url(worker, "extra")) as ws:
            error = await ws.receive_json(timeout=5)
            assert error["type"] == "error"
            assert error["code"] == "overloaded"
            await ws.receive(timeout=5)
            assert ws.close_code == 1013
        await asyncio.sleep(0.5)
        info = {w.worker_id: w for w in await registry.list_workers(redis_client, "realtime")}
        assert info["rt-test"].slots_free == 0
        assert registry.pick_worker(list(info.values())) is None
        for ws in held:
            await ws.close()
    for _ in range(50):
        if worker.engine.slots_free() == 2:
            break
        await asyncio.sleep(0.05)
    assert worker.engine.slots_free() == 2, "closed sessions give their slots back"


async def expect_error(http: aiohttp.ClientSession, url: str, send: Any, code: str,
                       close_code: int) -> None:
    async with http.ws_connect(url) as ws:
        first = await ws.receive_json(timeout=5)
        if first["type"] == "accepted":
            await send(ws)
            first = await ws.receive_json(timeout=5)
        assert first["type"] == "error"
        assert first["code"] == code, first
        msg = await ws.receive(timeout=5)
        assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert ws.close_code == close_code


async def test_bad_input_gets_an_error_and_never_touches_another_session(
    worker: RealtimeWorker, speech: Callable[..., Path],
) -> None:
    pcm, _ = read_pcm(speech(ONE))
    bystander = asyncio.create_task(stream(ws_url(worker, "ok"), pcm, 16000, pace_s=0.03))
    async with aiohttp.ClientSession() as http:
        async def nothing(ws: aiohttp.ClientWebSocketResponse) -> None:
            return None
        cases: list[tuple[str, Callable[[aiohttp.ClientWebSocketResponse], Any]]] = [
            (ws_url(worker, "odd"), lambda ws: ws.send_bytes(b"\x00\x01\x02")),
            (ws_url(worker, "json"), lambda ws: ws.send_str("{not json")),
            (ws_url(worker, "type"), lambda ws: ws.send_str('{"type":"pause"}')),
            (ws_url(worker, "list"), lambda ws: ws.send_str("[1, 2]")),
            (ws_url(worker, "deep"), lambda ws: ws.send_str("[" * 100_000 + "]" * 100_000)),
            (ws_url(worker, "rate", rate=96000), nothing),
            (f"{worker.url}{SESSION_PATH}?sample_rate=abc", nothing),
        ]
        for url, send in cases:
            await expect_error(http, url, send, "bad_request", 1008)
        async with http.ws_connect(ws_url(worker, "twice")) as ws:
            await ws.receive_json(timeout=5)
            await ws.send_str('{"type":"end"}')
            await ws.send_bytes(bytes(3200))  # audio after end
            events = [m async for m in ws]
            assert events[-1].json() in ({"type": "done"}, {
                "type": "error", "code": "bad_request", "message": "audio after end"})
    run = await bystander
    assert run.events[-1] == {"type": "done"}
    assert recall(ONE, run.final_text) >= SENTENCE_RECALL
    async with aiohttp.ClientSession() as http, http.get(f"{worker.url}/healthz") as resp:
        assert resp.status == 200


async def test_registry_probes_and_metrics(
    worker: RealtimeWorker, redis_client: aioredis.Redis, speech: Callable[..., Path],
) -> None:
    workers = await registry.list_workers(redis_client, "realtime")
    assert [(w.worker_id, w.lane, w.url, w.engine, w.slots_total) for w in workers] == [
        ("rt-test", "realtime", worker.url, "pocketsphinx", 2)]
    pcm, _ = read_pcm(speech(TWO))
    await stream(ws_url(worker, "m"), pcm, 16000, pace_s=0.0)
    async with aiohttp.ClientSession() as http:
        for path in ("/healthz", "/readyz"):
            async with http.get(worker.url + path) as resp:
                assert resp.status == 200, path
        async with http.get(worker.url + "/metrics") as resp:
            text = await resp.text()
    for name in ("lanegate_step_duration_seconds_count", "lanegate_realtime_factor_count",
                 "lanegate_audio_seconds_total", "lanegate_free_slots",
                 "lanegate_active_sessions", "lanegate_event_loop_lag_seconds_count"):
        assert f'{name}{{lane="realtime",worker="rt-test"}}' in text, name
    assert 'lanegate_soft_cuts_total{lane="realtime",reason=' in text, text[-3000:]
    await worker.stop()
    assert await registry.list_workers(redis_client, "realtime") == []


async def test_nocap_and_mixed_workers_take_whole_pending_audio(
    redis_client: aioredis.Redis, tmp_path: Path, speech: Callable[..., Path],
) -> None:
    engine = SimulatedEngine(Settings(engine="simulated"), slots=2)
    nocap = await start_worker(redis_client, engine, chunk_cap=False)
    assert not nocap.loop.limits.capped
    await nocap.stop()
    settings = Settings(worker_id="mixed-test", heartbeat_s=0.2, data_dir=str(tmp_path),
                        engine="simulated")
    mixed = RealtimeWorker(settings, engine, redis_client, lane="mixed")
    await mixed.start()
    try:
        assert not mixed.loop.limits.capped
        pcm, _ = read_pcm(speech(TWO))
        async with aiohttp.ClientSession() as http, http.ws_connect(
                ws_url(mixed, "mx")) as ws:
            accepted = await ws.receive_json(timeout=5)
            assert accepted == {"type": "accepted", "worker": "mixed-test", "lane": "mixed"}
            await ws.send_bytes(pcm + bytes(32000))
            await ws.send_str('{"type":"end"}')
            events = [m.json() async for m in ws]
        assert events[-1] == {"type": "done"}
        assert any(e["type"] == "final" and e["text"] for e in events)
        hyps = await mixed.loop.submit_batch([pcm])
        assert hyps == engine.transcribe_batch([pcm])
        listed = await registry.list_workers(redis_client, "realtime")
        assert [(w.worker_id, w.lane) for w in listed] == [("mixed-test", "mixed")]
        # a batch job is decoded by the same loop
        store = JobStore(redis_client, settings)
        job_id = new_id()
        store.blobs.path(job_id).write_bytes(pcm * 3)
        await store.submit(job_id=job_id, tenant="t", audio_seconds=len(pcm) * 3 / 32000)
        for _ in range(400):
            if (result := await store.result(job_id, "t")) is not None:
                break
            await asyncio.sleep(0.05)
        assert result is not None, "the mixed worker finished the job"
        assert result.text
    finally:
        await mixed.stop()


def spawn_worker(redis_url: str, tmp_path: Path, **env: str) -> subprocess.Popen[bytes]:
    full = {**os.environ, "LANEGATE_REDIS_URL": redis_url, "LANEGATE_ENGINE": "simulated",
            "LANEGATE_WORKER_ID": "drainer", "LANEGATE_HEARTBEAT_S": "0.2",
            "LANEGATE_DATA_DIR": str(tmp_path), **env}
    with open(tmp_path / "worker.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "lanegate.cli", "worker", "--lane",
                                 "realtime", "--slots", "2"], env=full, stderr=log)


async def wait_registered(redis_client: aioredis.Redis) -> registry.WorkerInfo:
    for _ in range(200):
        for info in await registry.list_workers(redis_client, "realtime"):
            if info.worker_id == "drainer":
                return info
        await asyncio.sleep(0.05)
    raise AssertionError("the worker never registered")


async def test_sigterm_drains_sessions_then_exits_0(
    redis_server: RedisServer, redis_client: aioredis.Redis, tmp_path: Path,
    speech: Callable[..., Path],
) -> None:
    proc = spawn_worker(redis_server.url, tmp_path, LANEGATE_DRAIN_TIMEOUT_S="1.0")
    try:
        info = await wait_registered(redis_client)
        pcm, _ = read_pcm(speech(ONE))
        url = f"{info.url}{SESSION_PATH}?session_id=d1&sample_rate=16000"
        async with aiohttp.ClientSession() as http:
            finishing = await http.ws_connect(url)
            stuck = await http.ws_connect(url.replace("d1", "d2"))
            for ws in (finishing, stuck):
                assert (await ws.receive_json(timeout=5))["type"] == "accepted"
                await ws.send_bytes(pcm)
            proc.send_signal(signal.SIGTERM)
            for _ in range(100):
                listed = await registry.list_workers(redis_client, "realtime")
                if listed and listed[0].draining:
                    break
                await asyncio.sleep(0.05)
            assert listed[0].draining, "the registry says draining"
            await expect_error(http, url.replace("d1", "d3"), None, "overloaded", 1013)
            await finishing.send_str('{"type":"end"}')
            ended = [m.json() async for m in finishing]
            assert ended[-1] == {"type": "done"}
            assert any(e["type"] == "final" and e["cut"] == "end" for e in ended)
            # the stuck session never ends; at the drain timeout it gets its finals + done
            flushed = [m.json() async for m in stuck]
            assert flushed[-1] == {"type": "done"}
            assert any(e["type"] == "final" for e in flushed)
            assert stuck.close_code == 1000
        assert await asyncio.to_thread(proc.wait, 20) == 0
        assert await registry.list_workers(redis_client, "realtime") == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (tmp_path / "worker.log").read_text()
    events = [json.loads(line)["event"] for line in log.splitlines() if line.startswith("{")]
    assert "drain_timeout" in events
    assert events.count("session_start") == 2
    assert "worker_stopped" in events



# --- the multiplexed link (/internal/v1/link) -------------------------------------------

RECORD = struct.Struct("<II")


def batch(*records: tuple[int, bytes]) -> bytes:
    return b"".join(RECORD.pack(ch, len(pcm)) + pcm for ch, pcm in records)


class RawLink:
    """A gateway's side of a link, by hand: every ``[ch, event]`` the worker sends, by
    channel, and how many text messages they came in."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.events: dict[int, list[dict[str, Any]]] = {}
        self.messages = 0
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                self.messages += 1
                for ch, event in json.loads(msg.data):
                    self.events.setdefault(ch, []).append(event)

    async def open(self, ch: int, session_id: str, rate: int = 16000) -> None:
        await self.ws.send_json({"op": "open", "ch": ch, "session_id": session_id,
                                 "sample_rate": rate, "language": "en"})

    async def wait(self, ch: int, kind: str, timeout_s: float = 30.0) -> dict[str, Any]:
        for _ in range(int(timeout_s / 0.02)):
            for event in self.events.get(ch, []):
                if event["type"] == kind:
                    return event
            await asyncio.sleep(0.02)
        raise AssertionError(f"no {kind} on channel {ch}: {self.events.get(ch)}")

    def run(self, ch: int) -> Run:
        return Run(events=[e for e in self.events.get(ch, []) if e["type"] != "closed"])


@contextlib.asynccontextmanager
async def raw_link(worker: RealtimeWorker) -> AsyncIterator[RawLink]:
    async with aiohttp.ClientSession() as http, http.ws_connect(worker.url + LINK_PATH) as ws:
        hello = await ws.receive_json(timeout=5)
        assert hello == {"type": "link", "worker": "rt-test", "lane": "realtime"}
        link = RawLink(ws)
        yield link
        link.reader.cancel()


async def slots_back(worker: RealtimeWorker, free: int = 2) -> None:
    for _ in range(100):
        if worker.engine.slots_free() == free:
            return
        await asyncio.sleep(0.05)
    assert worker.engine.slots_free() == free, "closed sessions give their slots back"


async def test_link_channels_get_their_own_events_from_batched_audio(
    worker: RealtimeWorker, speech: Callable[..., Path],
) -> None:
    one, _ = read_pcm(speech(ONE))
    two, _ = read_pcm(speech(TWO))
    one, two = one + bytes(32000), two + bytes(32000)
    frame = 16000 * FRAME_MS // 1000 * 2
    async with raw_link(worker) as link:
        await link.open(1, "la")
        await link.open(7, "lb")
        assert (await link.wait(1, "accepted"))["lane"] == "realtime"
        await link.wait(7, "accepted")
        for off in range(0, max(len(one), len(two)), frame):
            await link.ws.send_bytes(batch((1, one[off:off + frame]), (7, two[off:off + frame]),
                                           (99, bytes(frame))))  # 99: no such channel
            await asyncio.sleep(0.02)
        for ch in (1, 7):
            await link.ws.send_json({"op": "end", "ch": ch})
        for ch in (1, 7):
            await link.wait(ch, "done")
            assert (await link.wait(ch, "closed"))["code"] == 1000
        sent = sum(len(events) for events in link.events.values())
        assert link.messages < sent, "events of one tick share a message"
    a, b = link.run(1), link.run(7)
    assert a.events[-1] == b.events[-1] == {"type": "done"}
    assert a.of("partial")
    assert b.of("partial")
    assert recall(ONE, a.final_text) >= SENTENCE_RECALL, a.final_text
    assert recall(TWO, b.final_text) >= SENTENCE_RECALL, b.final_text
    assert recall(ONE, a.final_text) > recall(ONE, b.final_text)
    assert 99 not in link.events
    await slots_back(worker)


async def test_link_bad_input_errors_only_its_channel(worker: RealtimeWorker) -> None:
    async with raw_link(worker) as link:
        await link.open(1, "odd")
        await link.open(2, "fine")
        await link.open(3, "rate", rate=96000)
        await link.ws.send_json({"op": "open", "ch": 4, "sample_rate": "abc"})
        for ch in (1, 2):
            await link.wait(ch, "accepted")
        for ch in (3, 4):
            assert (await link.wait(ch, "error"))["code"] == "bad_request"
        await link.ws.send_bytes(batch((1, b"\x00\x01\x02"), (2, bytes(3200))))
        error = await link.wait(1, "error")
        assert error["code"] == "bad_request"
        assert "even byte count" in error["message"]
        assert (await link.wait(1, "closed"))["code"] == 1008
        await link.ws.send_bytes(batch((1, bytes(3200)), (2, bytes(3200))))  # 1 is gone
        await link.ws.send_json({"op": "end", "ch": 2})
        await link.ws.send_json({"op": "end", "ch": 2})
        error = await link.wait(2, "error")
        assert error["message"] == "end sent twice"
        assert [e["type"] for e in link.events[1]] == ["accepted", "error", "closed"]
    await slots_back(worker)


async def test_link_a_deeply_nested_op_closes_the_link_1008(worker: RealtimeWorker) -> None:
    async with raw_link(worker) as link:
        await link.ws.send_str('{"op":' * 100_000 + "1" + "}" * 100_000)
        await asyncio.wait_for(link.reader, 5)
        assert link.ws.close_code == 1008
    await slots_back(worker)


@pytest.mark.parametrize("data", [b"\x01\x00\x00", batch((1, bytes(10)))[:-4]])
async def test_link_malformed_binary_closes_the_link_1008_and_frees_its_slots(
    worker: RealtimeWorker, data: bytes,
) -> None:
    async with raw_link(worker) as link:
        await link.open(1, "m")
        await link.wait(1, "accepted")
        assert worker.engine.slots_free() == 1
        await link.ws.send_bytes(data)
        await asyncio.wait_for(link.reader, 5)
        assert link.ws.close_code == 1008
    await slots_back(worker)


async def test_link_overloaded_when_full_and_closing_the_link_frees_the_slots(
    worker: RealtimeWorker,
) -> None:
    async with raw_link(worker) as link:
        for ch in (1, 2):
            await link.open(ch, f"h{ch}")
            await link.wait(ch, "accepted")
        await link.open(3, "extra")
        assert (await link.wait(3, "error"))["code"] == "overloaded"
        await link.ws.send_json({"op": "abandon", "ch": 1})
        await slots_back(worker, free=1)
        await link.open(4, "again")
        await link.wait(4, "accepted")
        assert worker.engine.slots_free() == 0
        assert not [e for e in link.events[1] if e["type"] != "accepted"], "abandoned: silent"
    await slots_back(worker)


@pytest.mark.parametrize("session_id", ["f1-again", "f1"])
async def test_link_an_open_right_behind_an_abandon_on_a_full_worker_gets_the_slot(
    worker: RealtimeWorker, session_id: str,
) -> None:
    """A client that reconfigures its session (the OpenAI Realtime API's
    ``session.update``) on a full worker: the gateway abandons the channel and opens
    another in the same tick (with a new session id, or the same one), and both reach
    the worker before its step loop settles the abandon. The open must get the
    abandoned slot, not ``overloaded`` (or ``session exists``)."""
    async with raw_link(worker) as link:
        for ch in (1, 2):
            await link.open(ch, f"f{ch}")
            await link.wait(ch, "accepted")
        assert worker.engine.slots_free() == 0
        await link.ws.send_json({"op": "abandon", "ch": 1})  # no await yields between
        await link.open(3, session_id)
        for _ in range(250):
            if link.events.get(3):
                break
            await asyncio.sleep(0.02)
        assert link.events.get(3, [{}])[0].get("type") == "accepted", link.events.get(3)
        assert worker.engine.slots_free() == 0
        assert [e["type"] for e in link.events[1]] == ["accepted"], "abandoned: silent"
    await slots_back(worker)


# --- who may open sessions, and with which id --------------------------------------------


async def test_a_duplicate_session_id_is_refused_and_the_live_stream_is_untouched(
    worker: RealtimeWorker, speech: Callable[..., Path],
) -> None:
    pcm, _ = read_pcm(speech(ONE))
    live = asyncio.create_task(stream(ws_url(worker, "dup"), pcm, 16000, pace_s=0.03))
    for _ in range(100):
        if "dup" in worker.loop.sessions:
            break
        await asyncio.sleep(0.02)
    async with aiohttp.ClientSession() as http:
        await expect_error(http, ws_url(worker, "dup"), None, "session_exists", 1008)
    async with raw_link(worker) as link:
        await link.open(1, "dup")
        assert (await link.wait(1, "error"))["code"] == "session_exists"
    run = await live
    assert run.events[-1] == {"type": "done"}
    assert run.close_code == 1000
    assert recall(ONE, run.final_text) >= SENTENCE_RECALL, run.final_text
    await slots_back(worker)


async def test_internal_endpoints_refuse_a_caller_without_the_token(
    redis_client: aioredis.Redis, ps_engine: PocketsphinxEngine,
) -> None:
    w = await start_worker(redis_client, ps_engine, internal_token="s3cret-token")
    try:
        async with aiohttp.ClientSession() as http:
            for url in (ws_url(w, "x"), w.url + LINK_PATH):
                for headers in ({}, {INTERNAL_TOKEN_HEADER: "guess"},
                                {INTERNAL_TOKEN_HEADER: "s3cret-token-and-more"}):
                    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                        await http.ws_connect(url, headers=headers)
                    assert refused.value.status == 401
                    async with http.get(url.replace("ws://", "http://"),
                                        headers=headers) as response:
                        assert response.status == 401
                        assert (await response.json())["error"]["code"] == "unauthorized"
            good = {INTERNAL_TOKEN_HEADER: "s3cret-token"}
            async with http.ws_connect(ws_url(w, "ok"), headers=good) as ws:
                assert (await ws.receive_json(timeout=5))["type"] == "accepted"
            async with http.ws_connect(w.url + LINK_PATH, headers=good) as ws:
                assert (await ws.receive_json(timeout=5))["type"] == "link"
            async with http.get(w.url + "/healthz") as response:
                assert response.status == 200, "probes stay open for the orchestrator"
        await slots_back(w)
    finally:
        await w.stop()


def test_a_worker_on_a_network_address_without_a_token_refuses_to_start(
    redis_server: RedisServer,
) -> None:
    env = {**os.environ, "LANEGATE_REDIS_URL": redis_server.url, "LANEGATE_WORKER_HOST": "0.0.0.0",
           "LANEGATE_ENGINE": "simulated", "LANEGATE_INTERNAL_TOKEN": ""}
    proc = subprocess.run([sys.executable, "-m", "lanegate.cli", "worker", "--lane", "realtime"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "LANEGATE_INTERNAL_TOKEN" in proc.stderr


# --- a session's memory at the worker is bounded ---------------------------------------------


async def read_until_closed(ws: aiohttp.ClientWebSocketResponse) -> list[dict[str, Any]]:
    events = []
    async for msg in ws:
        if msg.type == aiohttp.WSMsgType.TEXT:
            events.append(json.loads(msg.data))
    return events


@pytest.mark.parametrize("flood", ["far_ahead", "many_pieces"])
async def test_a_client_sending_too_fast_is_refused_alone(
    redis_client: aioredis.Redis, speech: Callable[..., Path], flood: str,
) -> None:
    # the simulated engine at 0.1 s per audio second: 10x real time, so a flood wins
    sim = Settings(engine="simulated", sim_prefill_frame_ms=1.0)
    w = await start_worker(redis_client, SimulatedEngine(sim, slots=2), max_undecoded_s=5.0,
                           max_arrival_log=50)
    try:
        pcm, _ = read_pcm(speech(ONE))
        calm = asyncio.create_task(stream(ws_url(w, "calm"), pcm, 16000, pace_s=0.1))
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(w, "flood")) as ws:
            assert (await ws.receive_json(timeout=5))["type"] == "accepted"
            reader = asyncio.create_task(read_until_closed(ws))
            with contextlib.suppress(ConnectionError, RuntimeError):
                if flood == "far_ahead":  # 60 s of audio as fast as the socket takes it
                    for _ in range(600):
                        await ws.send_bytes(bytes(3200))
                else:  # one sample at a time, each after a pause
                    for _ in range(200):
                        await ws.send_bytes(b"\x01\x00")
                        await asyncio.sleep(0.003)
            events = await asyncio.wait_for(reader, 30)
            assert events[-1]["type"] == "error", events[-3:]
            assert events[-1]["code"] == "overloaded"
            assert ("max_undecoded_s" if flood == "far_ahead" else "max_arrival_log") \
                in events[-1]["message"]
            assert ws.close_code == 1013
        run = await calm
        assert run.events[-1] == {"type": "done"}, "the other session goes on"
        assert run.close_code == 1000
        await slots_back(w)
    finally:
        await w.stop()


async def test_a_client_that_leaves_after_end_is_not_decoded_for_no_one(
    redis_client: aioredis.Redis, speech: Callable[..., Path],
) -> None:
    # a client that ended its audio and left before its finals (it gave up waiting): the
    # worker drops the session at once, not after decoding its backlog for no one while
    # it holds a slot and the step loop (seen when 500 streams swamped two workers: new
    # sessions waited minutes behind the abandoned ones)
    sim = Settings(engine="simulated", sim_prefill_frame_ms=1.0)  # 10 x real time
    w = await start_worker(redis_client, SimulatedEngine(sim, slots=2))
    labels = {"lane": "realtime", "worker": "rt-test"}

    def decoded() -> float:
        return REGISTRY.get_sample_value("lanegate_audio_seconds_total", labels) or 0.0

    try:
        before = decoded()
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(w, "left")) as ws:
            assert (await ws.receive_json(timeout=5))["type"] == "accepted"
            pcm, _ = read_pcm(speech(ONE))
            audio = pcm * (60 * 32000 // len(pcm) + 1)  # 60 s of speech: 6 s of decoding
            for off in range(0, len(audio), 3200):
                await ws.send_bytes(audio[off:off + 3200])
            await ws.send_str(json.dumps({"type": "end"}))
        await slots_back(w)
        assert decoded() - before < 30, "the backlog of a client that left is dropped"
        run = await stream(ws_url(w, "next"), bytes(32000), 16000, pace_s=0.0)
        assert run.events[-1] == {"type": "done"}, "the next session is served"
    finally:
        await w.stop()


async def test_a_gateway_channel_whose_reader_lags_ends_overloaded_and_alone(
    worker: RealtimeWorker, speech: Callable[..., Path],
) -> None:
    pcm, _ = read_pcm(speech(ONE))
    pcm += bytes(32000)
    frame = 16000 * FRAME_MS // 1000 * 2
    async with aiohttp.ClientSession() as http:
        links = WorkerLinks(http, Settings(max_channel_events=3))
        try:
            link = await links.get(worker.info())
            lagging = link.open(session_id="lagging", sample_rate=16000, language="en")
            reading = link.open(session_id="reading", sample_rate=16000, language="en")
            seen: list[dict[str, Any]] = []

            async def read() -> None:
                while not seen or seen[-1].get("type") not in ("done", "error"):
                    event = await reading.events.get()
                    assert isinstance(event, dict), event
                    seen.append(event)

            reader = asyncio.create_task(read())
            for off in range(0, len(pcm), frame):
                await lagging.send_audio(pcm[off:off + frame])
                await reading.send_audio(pcm[off:off + frame])
                await asyncio.sleep(0.02)
            lagging.end()
            reading.end()
            await asyncio.wait_for(reader, 30)
            assert seen[-1] == {"type": "done"}
            assert recall(ONE, " ".join(e["text"] for e in seen if e["type"] == "final")) \
                >= SENTENCE_RECALL
            held = [lagging.events.get_nowait() for _ in range(lagging.events.qsize())]
            assert len(held) <= 4, "the lagging channel's queue stayed bounded"
            last = held[-1]
            assert isinstance(last, dict)
            assert last["type"] == "error"
            assert last["code"] == "overloaded"
            assert "max_channel_events" in last["message"]
            await slots_back(worker)
        finally:
            await links.close()
