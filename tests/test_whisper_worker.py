"""The realtime worker with the real Whisper base engine (one model per test session):
partials and finals over the internal WebSocket, language detection, and an event
loop that keeps answering while a long step runs in its thread."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest_asyncio
import redis.asyncio as aioredis
from conftest import RedisServer, read_pcm, synthesize
from phrases import LONG, TRAFFIC, recall
from test_realtime_worker import stream

from engines.whisper import WhisperEngine
from lanegate.settings import Settings
from workers.realtime import SESSION_PATH, RealtimeWorker

SPANISH = "mañana vamos a la playa con nuestros amigos"


@pytest_asyncio.fixture
async def worker(redis_server: RedisServer, whisper: WhisperEngine
                 ) -> AsyncIterator[RealtimeWorker]:
    client = aioredis.Redis.from_url(redis_server.url)
    w = RealtimeWorker(Settings(worker_id="rt-whisper", heartbeat_s=0.2), whisper, client)
    await w.start()
    yield w
    await w.stop()
    await client.aclose()


def url(worker: RealtimeWorker, session_id: str, **query: Any) -> str:
    extra = "".join(f"&{k}={v}" for k, v in query.items())
    return f"{worker.url}{SESSION_PATH}?session_id={session_id}&sample_rate=16000{extra}"


async def test_a_live_sentence_gets_partials_and_a_final_with_the_words(
        worker: RealtimeWorker, speech: Callable[..., Path]) -> None:
    pcm, _ = read_pcm(speech(TRAFFIC))
    run = await stream(url(worker, "w1", language="en"), pcm, 16000, pace_s=0.1)
    assert run.partials_before_end > 0, "partials arrive while audio is still being sent"
    partials = [p["text"] for p in run.of("partial")]
    assert all(b.startswith(a) for a, b in itertools.pairwise(partials)), partials
    finals = run.of("final")
    assert recall(TRAFFIC, run.final_text) >= 0.9, run.final_text
    assert finals[0]["language"] == "en"
    assert [w["word"] for w in finals[0]["words"]] == finals[0]["text"].split()
    assert run.events[-1] == {"type": "done"}


async def test_the_language_is_detected_when_none_is_given(
        worker: RealtimeWorker, tmp_path: Path) -> None:
    pcm, _ = read_pcm(synthesize(SPANISH, tmp_path / "es.wav", voice="es"))
    run = await stream(url(worker, "w2"), pcm, 16000, pace_s=0.0)
    assert [f["language"] for f in run.of("final")] == ["es"], run.events


async def test_the_loop_answers_while_a_long_step_runs(
        worker: RealtimeWorker, speech: Callable[..., Path]) -> None:
    """A client dumps 20 s at once: its segment's re-decode is a long step, run in the
    engine's thread; /healthz is answered while it runs (CTranslate2 releases the GIL)."""
    pcm, _ = read_pcm(speech(LONG))
    answered_in_step = 0
    async with aiohttp.ClientSession() as http:
        dump = asyncio.create_task(stream(url(worker, "w3", language="en"),
                                          pcm[: 20 * 32000], 16000, pace_s=0.0))
        while not dump.done():
            async with http.get(f"{worker.url}/healthz") as resp:
                assert resp.status == 200
                answered_in_step += worker.loop.stepping
            await asyncio.sleep(0.02)
        run = await dump
    assert answered_in_step > 0
    assert recall(LONG, run.final_text) >= 0.6, run.final_text


async def test_an_unknown_language_is_refused_and_takes_no_slot(worker: RealtimeWorker) -> None:
    free = worker.engine.slots_free()
    async with aiohttp.ClientSession() as http, \
            http.ws_connect(url(worker, "w9", language="xx")) as ws:
        event = await ws.receive_json(timeout=10)
    assert event["type"] == "error", event
    assert event["code"] == "bad_request"
    assert "'xx'" in event["message"]
    assert worker.engine.slots_free() == free, "a refused session gives its slot back"
