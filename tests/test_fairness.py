"""The batch lane shared fairly between API keys: round-robin scheduling across
tenants on top of the job stream, and per-key quotas on unfinished jobs and their
audio hours (429 + Retry-After at the gateway). Real redis-server, the real
gateway app in-process, a real batch consumer with the simulated engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest_asyncio
import redis.asyncio as aioredis
from aiohttp import web
from audio_files import silence_wav
from conftest import RedisServer, free_port

from engines import create_engine
from gateway.app import create_app
from lanegate.blobs import new_id
from lanegate.constants import TENANT_OPEN_KEY
from lanegate.redis_io import redis_client
from lanegate.settings import Settings
from lanes.job_protocol import Job
from lanes.jobs import JobStore
from lanes.queue import backlog
from workers.batch import BatchConsumer

KEY_A, KEY_B = "key-of-tenant-a", "key-of-tenant-b"


@pytest_asyncio.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = redis_client(redis_server.url)
    yield c
    await c.aclose()


def settings_for(redis_server: RedisServer, tmp_path: Path, **changes: Any) -> Settings:
    return Settings(redis_url=redis_server.url, blob_dir=str(tmp_path / "blobs"),
                    engine="simulated", heartbeat_s=0.2, **changes)


async def submit(store: JobStore, tenant: str, seconds: float = 2.0) -> Job:
    job_id = new_id()
    tone = (b"\x00\x10\x00\xf0" * 8000) * int(seconds)  # loud enough to hold words
    store.blobs.path(job_id).write_bytes(tone)
    job, _ = await store.submit(job_id=job_id, tenant=tenant, audio_seconds=seconds)
    return job


async def until_terminal(store: JobStore, job: Job, timeout_s: float = 120.0) -> Job:
    deadline = time.monotonic() + timeout_s
    while True:
        now = await store.get(job.id, job.tenant)
        assert now is not None
        if now.terminal:
            return now
        assert time.monotonic() < deadline, f"job {job.id} never finished"
        await asyncio.sleep(0.05)


async def test_one_tenants_backlog_does_not_delay_another_tenants_job(
    redis_server: RedisServer, client: aioredis.Redis, tmp_path: Path,
) -> None:
    settings = settings_for(redis_server, tmp_path, batch_max_jobs=2,
                            sim_prefill_frame_ms=0.5)
    store = JobStore(client, settings)
    a_jobs = [await submit(store, "tenant-a") for _ in range(20)]
    b_job = await submit(store, "tenant-b")
    assert (await backlog(client)).depth == 21, "waiting jobs count in the backlog"
    consumer = BatchConsumer(settings, client, create_engine(settings, slots=0),
                             worker_id="fair-1", webhooks=False)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        b_done = await until_terminal(store, b_job)
        a_done = [await until_terminal(store, j) for j in a_jobs]
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert {j.status for j in a_done} | {b_done.status} == {"completed"}
    assert b_done.started_at is not None
    later = [j for j in a_done if j.started_at is not None and j.started_at > b_done.started_at]
    assert len(later) >= 14, "B's one job started before most of A's 20"
    a_starts = [j.started_at for j in a_done]
    assert a_starts == sorted(a_starts), "each tenant's own jobs stay in order"
    assert (await backlog(client)).depth == 0


async def test_quotas_count_unfinished_jobs_and_free_when_they_finish(
    redis_server: RedisServer, client: aioredis.Redis, tmp_path: Path,
) -> None:
    from lanes.jobs import QuotaExceeded

    settings = settings_for(redis_server, tmp_path, max_queued_jobs_per_key=2,
                            max_queued_audio_hours_per_key=10 / 3600)
    store = JobStore(client, settings)
    first = await submit(store, "t1", 4.0)
    await submit(store, "t1", 4.0)
    refused = []
    for tenant, seconds in (("t1", 1.0), ("t2", 11.0)):
        try:
            await submit(store, tenant, seconds)
        except QuotaExceeded as exc:
            refused.append(exc.quota.value)
    assert refused == ["jobs", "audio"]
    await submit(store, "t2", 9.0)  # another key has its own quota
    assert (await store.cancel(first.id, "t1")) is not None
    third = await submit(store, "t1", 1.0)  # the cancelled job no longer counts
    assert await client.hlen(TENANT_OPEN_KEY.format(tenant="t1")) == 2
    consumer = BatchConsumer(settings, client, create_engine(settings, slots=0),
                             worker_id="quota-1", webhooks=False)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        assert (await until_terminal(store, third)).status == "completed"
        await submit(store, "t1", 1.0)  # completed jobs no longer count either
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def test_the_gateway_answers_429_with_retry_after_past_a_quota(
    redis_server: RedisServer, tmp_path: Path,
) -> None:
    settings = settings_for(redis_server, tmp_path, api_keys=f"{KEY_A},{KEY_B}",
                            max_queued_jobs_per_key=1)
    runner = web.AppRunner(create_app(settings), shutdown_timeout=10)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    wav = silence_wav(tmp_path / "long.wav", 40.0).read_bytes()  # over sync_max_seconds

    async def post(key: str) -> tuple[int, dict[str, Any], dict[str, str]]:
        data = aiohttp.FormData()
        data.add_field("file", wav, filename="long.wav", content_type="audio/wav")
        async with aiohttp.ClientSession() as http, http.post(
                f"http://127.0.0.1:{port}/v1/transcriptions", data=data,
                headers={"Authorization": f"Bearer {key}"}) as response:
            return response.status, await response.json(), dict(response.headers)

    try:
        assert (await post(KEY_A))[0] == 202
        status, body, headers = await post(KEY_A)
        assert status == 429
        assert body["error"]["code"] == "quota_exceeded"
        assert "max_queued_jobs_per_key" in body["error"]["message"]
        assert int(headers["Retry-After"]) > 0
        assert (await post(KEY_B))[0] == 202, "the other key is not refused"
        blobs = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
        assert len(blobs) == 2, "the refused upload left no blob behind"
    finally:
        await runner.cleanup()
