"""The batch lane with the real Whisper base engine: a 3-minute job through a
``BatchConsumer`` (real Redis), batched decoding, word timings, the detected language."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio
import redis.asyncio as aioredis
from conftest import RedisServer, read_pcm, synthesize
from phrases import PARAGRAPH, recall

from engines.whisper import WhisperEngine
from lanegate.blobs import new_id
from lanegate.settings import Settings
from lanes.jobs import Job, JobStore
from workers.batch import BatchConsumer

THREE_MINUTES = ". ".join([PARAGRAPH] * 12)  # about 184 s at the fixture's voice and pace


@pytest_asyncio.fixture
async def store(redis_server: RedisServer, tmp_path: Path) -> AsyncIterator[JobStore]:
    settings = Settings(redis_url=redis_server.url, blob_dir=str(tmp_path / "blobs"))
    client = aioredis.Redis.from_url(settings.redis_url)
    yield JobStore(client, settings)
    await client.aclose()


async def test_a_three_minute_job_completes_with_word_timings_and_its_language(
        store: JobStore, whisper: WhisperEngine, speech_dir: Path) -> None:
    path = speech_dir / "whisper_three_minutes.wav"
    if not path.exists():
        synthesize(THREE_MINUTES, path)
    pcm, _ = read_pcm(path)
    duration = len(pcm) / 32000
    assert duration > 170
    job_id = new_id()
    store.blobs.path(job_id).write_bytes(pcm)
    await store.submit(job_id=job_id, tenant="t1", audio_seconds=duration, language="")
    consumer = BatchConsumer(store.settings, store.redis, whisper, worker_id="wb")
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    progress: list[float] = []
    deadline = time.monotonic() + 600
    job: Job | None = None
    while time.monotonic() < deadline:
        job = await store.get(job_id, "t1")
        assert job is not None
        if not progress or job.progress != progress[-1]:
            progress.append(job.progress)
        if job.terminal:
            break
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(task, 60)
    assert job is not None
    assert job.status == "completed", job.error
    assert any(0.0 < p < 1.0 for p in progress), progress  # written after each batch
    result = await store.result(job_id, "t1")
    assert result is not None
    assert result.language == "en"  # none given: detected
    assert recall(PARAGRAPH, result.text) >= 0.9, result.text[:500]
    words = [w for s in result.segments for w in s.words]
    assert len(words) > 300
    assert all(0.0 <= w.start <= w.end <= duration + 0.01 for w in words)
    starts = [w.start for w in words]
    assert starts == sorted(starts)
