"""lanes/jobs.py and lanes/queue.py against a real redis-server (AOF on)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from conftest import RedisServer

from engines.base import Task
from lanegate.blobs import BlobStore, new_id
from lanegate.constants import (
    DEAD_LETTER_STREAM,
    JOB_GROUP,
    JOB_KEY,
    JOB_STREAM,
    RESULT_KEY,
    TENANT_JOBS_KEY,
)
from lanegate.redis_io import redis_client
from lanegate.settings import Settings
from lanegate.transcript import Segment, Transcript
from lanes.job_protocol import Delivery, Job
from lanes.jobs import JobNotFound, JobStore
from lanes.queue import JobQueue

Env = tuple[JobStore, Callable[[str], JobQueue], Settings, aioredis.Redis]


@pytest.fixture
async def env_factory(
    redis_server: RedisServer, tmp_path: Path
) -> AsyncIterator[Callable[..., Env]]:
    """``make(**settings)`` -> (JobStore, queue_for(consumer), settings, client)."""
    clients: list[aioredis.Redis] = []

    def make(**overrides: Any) -> Env:
        settings = Settings(redis_url=redis_server.url, blob_dir=str(tmp_path / "blobs"),
                            **overrides)
        client = redis_client(settings.redis_url)
        clients.append(client)

        def queue_for(consumer: str) -> JobQueue:
            return JobQueue(client, settings, consumer)

        return JobStore(client, settings), queue_for, settings, client

    yield make
    for client in clients:
        await client.aclose()


@pytest.fixture
def env(env_factory: Callable[..., Env]) -> Env:
    return env_factory()


async def submit(store: JobStore, tenant: str = "t1", **kwargs: Any) -> tuple[Job, bool]:
    job_id = new_id()
    store.blobs.path(job_id).write_bytes(b"\x00\x00" * 1600)
    return await store.submit(job_id=job_id, tenant=tenant, audio_seconds=0.1, **kwargs)


async def deliver(queue: JobQueue) -> Delivery:
    await queue.ensure_group()
    got = await queue.read(1)
    assert len(got) == 1
    return got[0]


def transcript(text: str = "hello world") -> Transcript:
    return Transcript.from_segments([Segment(0.0, 1.0, text)], duration=1.0)


# --- JobStore -------------------------------------------------------------------------


async def test_submit_get_and_public_json(env: Env) -> None:
    store, _, _, client = env
    job, created = await submit(store, language="de", response_format="srt",
                                webhook_url="http://127.0.0.1:9/hook", filename="a.wav")
    assert created
    assert job.status == "queued"
    assert job.attempts == 0
    assert job.progress == 0.0
    public = job.to_public()
    assert public["id"] == job.id
    assert public["status"] == "queued"
    assert public["language"] == "de"
    assert public["response_format"] == "srt"
    assert public["filename"] == "a.wav"
    assert public["started_at"] is None
    assert "tenant" not in public
    assert "worker" not in public
    json.dumps(public)
    assert await client.xlen(JOB_STREAM) == 1
    assert await store.get(job.id, "t1") == job


async def test_decoder_options_are_kept_and_stay_internal(env: Env) -> None:
    store, _, _, _ = env
    asked, _ = await submit(store, prompt="Kubernetes, Redis", temperature=0.4,
                            task=Task.TRANSLATE)
    plain, _ = await submit(store)
    assert (await store.get(asked.id, "t1")) == asked
    assert (asked.language, asked.prompt, asked.temperature, asked.task) == (
        "", "Kubernetes, Redis", 0.4, Task.TRANSLATE)
    assert (plain.language, plain.prompt, plain.temperature, plain.task) == (
        "", "", None, Task.TRANSCRIBE)
    assert asked.to_public()["language"] == ""  # none asked: the result reports the detected
    assert {"prompt", "temperature", "task"}.isdisjoint(asked.to_public())


async def test_submit_rejects_ids_that_are_not_blob_ids(env: Env) -> None:
    store, _, _, _ = env
    with pytest.raises(ValueError, match="blob id"):
        await store.submit(job_id="../../etc/passwd", tenant="t1", audio_seconds=1.0)


async def test_tenant_isolation(env: Env) -> None:
    store, queue_for, _, _ = env
    job, _ = await submit(store, tenant="alice")
    assert await store.get(job.id, "bob") is None
    assert await store.result(job.id, "bob") is None
    assert await store.cancel(job.id, "bob") is None
    assert (await store.list_jobs("bob"))[0] == []
    with pytest.raises(JobNotFound):
        await store.wait(job.id, "bob", timeout_s=0.1)
    assert (await store.get(job.id, "alice")) is not None
    # the job was not touched by bob's cancel
    queue = queue_for("w1")
    started = await queue.start(await deliver(queue))
    assert started.outcome == "run"


async def test_idempotency_key_returns_the_same_job(env: Env) -> None:
    store, _, _, client = env
    first, created1 = await submit(store, idempotency_key="k1")
    again, created2 = await submit(store, idempotency_key="k1")
    other, created3 = await submit(store, idempotency_key="k2")
    foreign, created4 = await submit(store, tenant="t2", idempotency_key="k1")
    assert (created1, created2, created3, created4) == (True, False, True, True)
    assert again.id == first.id
    assert len({first.id, other.id, foreign.id}) == 3
    assert await client.xlen(JOB_STREAM) == 3


async def test_idempotency_is_atomic_under_races(env: Env) -> None:
    store, _, _, client = env
    results = await asyncio.gather(*(submit(store, idempotency_key="race") for _ in range(20)))
    assert sum(created for _, created in results) == 1
    assert len({job.id for job, _ in results}) == 1
    assert await client.xlen(JOB_STREAM) == 1


async def test_idempotency_key_expires(env_factory: Callable[..., Env]) -> None:
    store, _, _, _ = env_factory(idempotency_ttl_s=0.2)
    first, _ = await submit(store, idempotency_key="k")
    await asyncio.sleep(0.4)
    second, created = await submit(store, idempotency_key="k")
    assert created
    assert second.id != first.id


async def test_list_jobs_newest_first_with_cursor(env: Env) -> None:
    store, _, _, _ = env
    ids = [(await submit(store))[0].id for _ in range(7)]
    await submit(store, tenant="other")
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        jobs, cursor = await store.list_jobs("t1", limit=3, cursor=cursor)
        seen += [j.id for j in jobs]
        pages += 1
        if cursor is None:
            break
    assert seen == ids[::-1]
    assert pages == 3
    with pytest.raises(ValueError, match="cursor"):
        await store.list_jobs("t1", cursor="garbage")


async def test_list_jobs_handles_equal_timestamps(env: Env) -> None:
    store, _, _, client = env
    ids = [(await submit(store))[0].id for _ in range(5)]
    key = TENANT_JOBS_KEY.format(tenant="t1")
    await client.zadd(key, dict.fromkeys(ids, 1000.0))  # force ties
    seen: list[str] = []
    cursor: str | None = None
    while True:
        jobs, cursor = await store.list_jobs("t1", limit=2, cursor=cursor)
        seen += [j.id for j in jobs]
        if cursor is None:
            break
    assert sorted(seen) == sorted(ids)
    assert len(seen) == 5


async def test_list_jobs_drops_expired_jobs(env: Env) -> None:
    store, _, _, client = env
    keep, _ = await submit(store)
    gone, _ = await submit(store)
    await client.delete(JOB_KEY.format(job_id=gone.id))
    jobs, cursor = await store.list_jobs("t1")
    assert [j.id for j in jobs] == [keep.id]
    assert cursor is None
    assert await client.zcard(TENANT_JOBS_KEY.format(tenant="t1")) == 1


async def test_cancel_queued_job_deletes_audio(env: Env) -> None:
    store, queue_for, _, _ = env
    job, _ = await submit(store)
    assert store.blobs.exists(job.id)
    cancelled = await store.cancel(job.id, "t1")
    assert cancelled is not None
    assert cancelled.status == "cancelled"
    assert cancelled.finished_at is not None
    assert not store.blobs.exists(job.id)
    # a worker that reads the entry later drops it without running it
    queue = queue_for("w1")
    started = await queue.start(await deliver(queue))
    assert (started.outcome, started.reason) == ("skip", "cancelled")
    assert await queue.redis.xlen(JOB_STREAM) == 0


async def test_cancel_processing_job_refuses_its_result(env: Env) -> None:
    store, queue_for, _, client = env
    job, _ = await submit(store)
    queue = queue_for("w1")
    d = await deliver(queue)
    started = await queue.start(d)
    assert (await store.cancel(job.id, "t1")).status == "cancelled"  # type: ignore[union-attr]
    assert await queue.states({job.id: started.attempt}) == {job.id: "cancelled"}
    assert not await queue.complete(d, started.attempt, transcript())
    assert await client.get(RESULT_KEY.format(job_id=job.id)) is None
    assert await store.result(job.id, "t1") is None
    pending = await client.xpending(JOB_STREAM, JOB_GROUP)
    assert pending["pending"] == 0  # the refused completion still acknowledged the entry


async def test_cancel_finished_job_changes_nothing(env: Env) -> None:
    store, queue_for, _, _ = env
    job, _ = await submit(store)
    queue = queue_for("w1")
    d = await deliver(queue)
    started = await queue.start(d)
    assert await queue.complete(d, started.attempt, transcript())
    after = await store.cancel(job.id, "t1")
    assert after is not None
    assert after.status == "completed"
    assert (await store.result(job.id, "t1")) == transcript()


async def test_wait_returns_on_terminal_status_or_timeout(env: Env) -> None:
    store, queue_for, _, _ = env
    job, _ = await submit(store)
    assert (await store.wait(job.id, "t1", timeout_s=0.2)).status == "queued"
    queue = queue_for("w1")
    d = await deliver(queue)
    started = await queue.start(d)

    async def finish_later() -> None:
        await asyncio.sleep(0.3)
        await queue.complete(d, started.attempt, transcript("done"))

    task = asyncio.create_task(finish_later())
    waited = await store.wait(job.id, "t1", timeout_s=30)
    await task
    assert waited.status == "completed"
    assert waited.progress == 1.0
    result = await store.result(job.id, "t1")
    assert result is not None
    assert result.text == "done"


async def test_finished_jobs_expire_after_job_ttl(env_factory: Callable[..., Env]) -> None:
    store, queue_for, _, client = env_factory(job_ttl_s=0.5)
    job, _ = await submit(store)
    queue = queue_for("w1")
    d = await deliver(queue)
    started = await queue.start(d)
    await queue.complete(d, started.attempt, transcript())
    assert 0 < await client.pttl(JOB_KEY.format(job_id=job.id)) <= 500
    assert 0 < await client.pttl(RESULT_KEY.format(job_id=job.id)) <= 500
    await asyncio.sleep(0.7)
    assert await store.get(job.id, "t1") is None
    assert await store.result(job.id, "t1") is None


# --- JobQueue: ownership, reclaim, dead letter -------------------------------------------


async def test_one_result_when_a_slow_owner_is_reclaimed(
    env_factory: Callable[..., Env],
) -> None:
    store, queue_for, _, client = env_factory(claim_idle_s=0.2)
    job, _ = await submit(store)
    slow, fast = queue_for("slow"), queue_for("fast")
    d1 = await deliver(slow)
    s1 = await slow.start(d1)
    await asyncio.sleep(0.3)
    (d2,) = await fast.reclaim(5)
    assert d2.entry_id == d1.entry_id
    s2 = await fast.start(d2)
    assert (s1.attempt, s2.attempt) == (1, 2)
    assert await slow.touch([d1.entry_id]) == set()  # it knows it lost the entry
    assert await slow.states({job.id: s1.attempt}) == {job.id: "lost"}
    assert not await slow.progress(d1, s1.attempt, 0.5)
    assert not await slow.complete(d1, s1.attempt, transcript("slow"))
    assert await fast.complete(d2, s2.attempt, transcript("fast"))
    assert (await store.result(job.id, "t1")).text == "fast"  # type: ignore[union-attr]
    assert await client.xlen(JOB_STREAM) == 0


async def test_a_retried_finish_gets_the_same_answer(env: Env) -> None:
    """The client library retries a call whose connection dropped (a Redis failover);
    when the first run had landed, the retry must not say the job was lost."""
    store, queue_for, _, client = env
    done, _ = await submit(store)
    failed, _ = await submit(store)
    queue = queue_for("w")
    d_done = await deliver(queue)
    s_done = await queue.start(d_done)
    d_failed = await deliver(queue)
    s_failed = await queue.start(d_failed)
    assert await queue.complete(d_done, s_done.attempt, transcript("first"))
    assert await queue.complete(d_done, s_done.attempt, transcript("retried"))
    assert (await store.result(done.id, "t1")).text == "first"  # type: ignore[union-attr]
    assert await queue.fail(d_failed, s_failed.attempt, "bad audio")
    assert await queue.fail(d_failed, s_failed.attempt, "bad audio")
    # another attempt number is still refused
    assert not await queue.complete(d_done, s_done.attempt + 1, transcript("other"))
    assert not await queue.complete(d_failed, s_failed.attempt, transcript("late"))
    assert (await store.get(failed.id, "t1")).status == "failed"  # type: ignore[union-attr]
    assert await client.xlen(JOB_STREAM) == 0


async def test_reclaim_scans_past_many_live_entries(env_factory: Callable[..., Env]) -> None:
    store, queue_for, _, _ = env_factory(claim_idle_s=0.2)
    jobs = [(await submit(store))[0] for _ in range(25)]
    live, dead, other = queue_for("live"), queue_for("dead"), queue_for("other")
    await live.ensure_group()
    held = await live.read(24)
    (lost,) = await dead.read(1)
    await asyncio.sleep(0.3)
    assert len(await live.touch([d.entry_id for d in held])) == 24
    found = await other.reclaim(1)
    assert [d.job_id for d in found] == [jobs[-1].id] == [lost.job_id]


async def test_touch_keeps_an_entry_from_being_reclaimed(
    env_factory: Callable[..., Env],
) -> None:
    store, queue_for, _, _ = env_factory(claim_idle_s=0.3)
    await submit(store)
    owner, other = queue_for("owner"), queue_for("other")
    d = await deliver(owner)
    await owner.start(d)
    for _ in range(4):
        await asyncio.sleep(0.15)
        assert await owner.touch([d.entry_id]) == {d.entry_id}
        assert await other.reclaim(5) == []


async def test_dead_letter_after_max_attempts(env_factory: Callable[..., Env]) -> None:
    store, queue_for, _, client = env_factory(claim_idle_s=0.05, max_attempts=2)
    job, _ = await submit(store, webhook_url="http://127.0.0.1:9/hook")
    queue = queue_for("w")
    d = await deliver(queue)
    assert (await queue.start(d)).attempt == 1
    await asyncio.sleep(0.1)
    (d,) = await queue.reclaim(5)
    assert (await queue.start(d)).attempt == 2
    await asyncio.sleep(0.1)
    (d,) = await queue.reclaim(5)
    started = await queue.start(d)
    assert started.outcome == "dead"
    assert "gave up after 2 attempts" in started.reason
    failed = await store.get(job.id, "t1")
    assert failed is not None
    assert failed.status == "failed"
    assert failed.attempts == 2
    assert failed.error == started.reason
    dead = await client.xrange(DEAD_LETTER_STREAM)
    assert len(dead) == 1
    assert dead[0][1][b"job_id"] == job.id.encode()
    assert await client.xlen(JOB_STREAM) == 0
    assert (await client.xpending(JOB_STREAM, JOB_GROUP))["pending"] == 0


async def test_engine_errors_count_attempts_and_reach_the_dead_letter(
    env_factory: Callable[..., Env],
) -> None:
    store, queue_for, _, client = env_factory(max_attempts=2)
    job, _ = await submit(store)
    queue = queue_for("w")
    for attempt in (1, 2):
        d = await deliver(queue)
        started = await queue.start(d)
        assert started.attempt == attempt
        assert await queue.release(d, attempt, count_attempt=True, error="engine error: boom")
    started = await queue.start(await deliver(queue))
    assert started.outcome == "dead"
    assert "engine error: boom" in started.reason
    assert (await store.get(job.id, "t1")).status == "failed"  # type: ignore[union-attr]
    assert await client.xlen(DEAD_LETTER_STREAM) == 1


async def test_hand_back_gives_the_attempt_back(env: Env) -> None:
    store, queue_for, _, client = env
    job, _ = await submit(store)
    queue = queue_for("w")
    d1 = await deliver(queue)
    s1 = await queue.start(d1)
    await queue.progress(d1, s1.attempt, 0.5)
    assert await queue.release(d1, s1.attempt, count_attempt=False)
    back = await store.get(job.id, "t1")
    assert back is not None
    assert back.status == "queued"
    assert back.attempts == 0
    assert back.progress == 0.0
    d2 = await deliver(queue)
    assert d2.entry_id != d1.entry_id
    assert (await queue.start(d2)).attempt == 1
    # the old entry, if it were ever seen again, is stale
    assert (await queue.start(d1)).reason == "stale"
    assert await client.xlen(JOB_STREAM) == 1


async def test_fail_is_final_and_acknowledged(env: Env) -> None:
    store, queue_for, _, client = env
    job, _ = await submit(store)
    queue = queue_for("w")
    d = await deliver(queue)
    s = await queue.start(d)
    assert await queue.fail(d, s.attempt, "audio blob is missing")
    failed = await store.get(job.id, "t1")
    assert failed is not None
    assert failed.status == "failed"
    assert failed.error == "audio blob is missing"
    assert failed.attempts == 1
    assert await client.xlen(JOB_STREAM) == 0


async def test_queue_wait_start_is_recorded_once(env_factory: Callable[..., Env]) -> None:
    store, queue_for, _, _ = env_factory(claim_idle_s=0.05)
    await submit(store)
    queue = queue_for("w")
    first = await queue.start(await deliver(queue))
    await asyncio.sleep(0.1)
    (d,) = await queue.reclaim(5)
    second = await queue.start(d)
    assert first.first
    assert not second.first
    assert first.job is not None
    assert second.job is not None
    assert first.job.started_at == second.job.started_at


async def test_own_pending_entries_are_redelivered_to_the_same_consumer(env: Env) -> None:
    store, queue_for, _, _ = env
    await submit(store)
    d = await deliver(queue_for("w1"))
    again = await queue_for("w1").read_own_pending()
    assert [x.entry_id for x in again] == [d.entry_id]
    assert await queue_for("w2").read_own_pending() == []


async def test_redis_restart_keeps_jobs_and_pending_entries(
    env_factory: Callable[..., Env], redis_server: RedisServer,
) -> None:
    store, queue_for, _, client = env_factory()
    running, _ = await submit(store)
    queued = [(await submit(store))[0] for _ in range(3)]
    queue = queue_for("w")
    d = await deliver(queue)
    s = await queue.start(d)
    redis_server.restart()
    assert (await store.get(running.id, "t1")).status == "processing"  # type: ignore[union-attr]
    for job in queued:
        assert (await store.get(job.id, "t1")).status == "queued"  # type: ignore[union-attr]
    assert await queue.touch([d.entry_id]) == {d.entry_id}
    assert await queue.complete(d, s.attempt, transcript())
    rest = await queue.read(10)
    assert sorted(x.job_id for x in rest) == sorted(j.id for j in queued)
    assert BlobStore(store.settings.blob_path).exists(running.id)
    assert await client.ping()
