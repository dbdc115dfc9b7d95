"""The realtime worker over its internal WebSocket: real Redis, real pocketsphinx,
real espeak-ng speech, a real aiohttp client; SIGTERM drain on a real subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import signal
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
from wsrun import Run

from lanegate.blobs import new_id
from lanegate.settings import Settings
from lanes.jobs import JobStore
from workers import registry
from workers.engines import Engine
from workers.engines.pocketsphinx import PocketsphinxEngine
from workers.engines.simulated import SimulatedEngine
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

