"""What an OS crash under ``appendfsync everysec`` can do to a job, for real: a
redis-server whose data directory is put back to what had reached the disk before
the crash (the lost last second of writes), a real batch consumer, the real blob
store. The job must end ``failed`` with a clear reason, never stuck."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from conftest import RedisServer
from redis.exceptions import ConnectionError as RedisConnectionError

from engines import create_engine
from lanegate.blobs import new_id
from lanegate.constants import DEAD_LETTER_STREAM, JOB_GROUP, JOB_STREAM
from lanegate.redis_io import redis_client
from lanegate.settings import Settings
from lanes.jobs import Job, JobStore
from workers.batch import BatchConsumer

SPEECHLIKE = (b"\x00\x10\x00\xf0" * 8000) * 2  # 2 s of a loud square wave


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    connection = redis_client(redis_server.url)
    yield connection
    await connection.aclose()


async def _consume_until(settings: Settings, client: aioredis.Redis, store: JobStore,
                         job_id: str, done: Callable[[Job], bool]) -> Job:
    """Run a batch consumer until the job satisfies ``done``; then stop it."""
    consumer = BatchConsumer(settings, client, create_engine(settings, slots=0),
                             worker_id=f"w-{new_id()[:6]}")
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert not task.done(), task
            job = await store.get(job_id, "t1")
            if job is not None and done(job):
                return job
            assert time.monotonic() < deadline, job
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task


async def test_a_completion_lost_in_an_os_crash_ends_failed_with_the_reason(
    redis_server: RedisServer, client: aioredis.Redis, tmp_path: Path,
) -> None:
    settings = Settings(redis_url=redis_server.url, blob_dir=str(tmp_path / "blobs"),
                        engine="simulated", heartbeat_s=0.2)
    store = JobStore(client, settings)
    job_id = new_id()
    store.blobs.path(job_id).write_bytes(SPEECHLIKE)
    await store.submit(job_id=job_id, tenant="t1", audio_seconds=len(SPEECHLIKE) / 32000)

    # what is on the disk when the machine dies: the fixture's Redis fsyncs every write
    # (`always`), so a copy now is what `everysec` would have kept had the crash come
    # within a second of the completion below
    on_disk = tmp_path / "redis-at-crash"
    shutil.copytree(redis_server.workdir, on_disk)

    completed = await _consume_until(settings, client, store, job_id, lambda j: j.terminal)
    assert completed.status == "completed"
    assert not store.blobs.exists(job_id)  # the audio goes once the result is stored

    # the OS crash: Redis dies and restarts from the AOF that had reached the disk
    redis_server.kill()
    shutil.rmtree(redis_server.workdir)
    shutil.copytree(on_disk, redis_server.workdir)
    redis_server.start()
    for _ in range(50):  # the client's pooled connections died with the server
        try:
            await client.ping()
            break
        except RedisConnectionError:
            await asyncio.sleep(0.1)
    replayed = await store.get(job_id, "t1")
    assert replayed is not None
    assert replayed.status == "queued"  # Redis forgot the start and the completion

    job = await _consume_until(settings, client, store, job_id, lambda j: j.terminal)
    assert (job.status, job.error, job.attempts) == ("failed", "audio blob is missing", 1)
    assert await store.result(job_id, "t1") is None
    assert await client.xlen(DEAD_LETTER_STREAM) == 0
    assert await client.xlen(JOB_STREAM) == 0
    assert (await client.xpending(JOB_STREAM, JOB_GROUP))["pending"] == 0
