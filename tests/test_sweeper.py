"""Orphaned blobs are swept on a schedule, never a live job's: the sweep on its own
against a real redis-server and a real blob directory, and a real batch worker
process that sweeps while it decodes a job whose blob is just as old."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio
import redis.asyncio as aioredis
from conftest import RedisServer, free_port

from lanegate.blobs import BlobStore, new_id
from lanegate.redis_io import redis_client
from lanegate.settings import Settings
from lanes.job_protocol import Job
from lanes.jobs import JobStore
from lanes.queue import JobQueue
from lanes.sweeper import BlobSweeper

REPO = Path(__file__).resolve().parent.parent
HOUR = 3600.0


@pytest_asyncio.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = redis_client(redis_server.url)
    yield c
    await c.aclose()


def age(blobs: BlobStore, blob_id: str, seconds: float) -> None:
    """Make a blob look untouched for ``seconds``."""
    past = time.time() - seconds
    directory = blobs.dir(blob_id)
    for path in [*directory.iterdir(), directory]:
        os.utime(path, (past, past))


async def job_with_blob(store: JobStore, pcm: bytes, tenant: str = "t1") -> Job:
    job_id = new_id()
    store.blobs.path(job_id).write_bytes(pcm)
    job, _ = await store.submit(job_id=job_id, tenant=tenant, audio_seconds=len(pcm) / 32000)
    return job


async def test_a_sweep_deletes_old_orphans_and_keeps_live_and_young_blobs(
    redis_server: RedisServer, client: aioredis.Redis, tmp_path: Path,
) -> None:
    settings = Settings(redis_url=redis_server.url, blob_dir=str(tmp_path / "blobs"),
                        blob_sweep_min_age_s=HOUR)
    store = JobStore(client, settings)
    pcm = bytes(32000)
    queued = await job_with_blob(store, pcm)
    processing = await job_with_blob(store, pcm)
    finished = await job_with_blob(store, pcm)
    queue = JobQueue(client, settings, "c1")
    await queue.ensure_group()
    for delivery in await queue.read(3):
        started = await queue.start(delivery)
        if delivery.job_id == finished.id:
            assert await queue.fail(delivery, started.attempt, "test: failed elsewhere")
    cancelled = await job_with_blob(store, pcm)
    await client.hset(f"lanegate:job:{cancelled.id}", "status", "cancelled")
    orphan = new_id()  # a gateway died before submitting it
    store.blobs.path(orphan).write_bytes(pcm)
    young_orphan = new_id()  # an upload still being written, or about to be submitted
    store.blobs.path(young_orphan).write_bytes(pcm)
    for blob_id in (queued.id, processing.id, finished.id, cancelled.id, orphan):
        age(store.blobs, blob_id, 2 * HOUR)

    deleted = await BlobSweeper(client, settings).sweep()

    assert sorted(deleted) == sorted([finished.id, cancelled.id, orphan])
    for kept in (queued.id, processing.id, young_orphan):
        assert store.blobs.exists(kept)
    for gone in deleted:
        assert not store.blobs.dir(gone).exists()


async def test_a_batch_worker_sweeps_on_schedule_and_spares_the_job_it_decodes(
    redis_server: RedisServer, client: aioredis.Redis, tmp_path: Path,
    speech_dir: Path,
) -> None:
    settings = Settings(redis_url=redis_server.url, blob_dir=str(tmp_path / "blobs"),
                        engine="simulated", sim_prefill_frame_ms=2.0, max_window_s=5.0,
                        soft_cut_search_s=2.0, batch_max_audio_s=5.0, batch_window_s=5.0,
                        blob_sweep_interval_s=0.3, blob_sweep_min_age_s=HOUR,
                        worker_id="sweeper-1", worker_port=free_port())
    store = JobStore(client, settings)
    tone = (b"\x00\x10\x00\xf0" * 8000) * 30  # 30 s, about 6 s to decode at this cost
    job = await job_with_blob(store, tone)
    age(store.blobs, job.id, 2 * HOUR)  # as old as any orphan
    orphan = new_id()
    store.blobs.path(orphan).write_bytes(tone)
    age(store.blobs, orphan, 2 * HOUR)
    proc = start_batch_worker(settings, tmp_path / "worker.log")
    try:
        deadline = time.monotonic() + 120
        while store.blobs.dir(orphan).exists():
            assert time.monotonic() < deadline, "the orphan was never swept"
            await asyncio.sleep(0.1)
        while not (now := await store.get(job.id, "t1")) or not now.terminal:
            assert time.monotonic() < deadline, "the job never finished"
            await asyncio.sleep(0.1)
        assert now.status == "completed", now.error
        assert now.attempts == 1
    finally:
        proc.terminate()
        proc.wait(60)


def start_batch_worker(settings: Settings, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "workers.batch"], cwd=REPO,
                                env={**os.environ, **settings.to_env()}, stdout=out,
                                stderr=out)
