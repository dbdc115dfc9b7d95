"""The worker registry against a real Redis: heartbeats expire, the least loaded
worker with a free slot is picked, draining workers are skipped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from lanes import registry
from lanes.registry import WorkerInfo, list_workers, pick_worker, publish
from tests.conftest import RedisServer


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_server.url)
    yield c
    await c.aclose()


def info(worker_id: str, free: int, total: int = 4, *, lane: str = "realtime",
         draining: bool = False) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, lane=lane, url=f"http://127.0.0.1/{worker_id}",
                      engine="simulated", slots_total=total, slots_free=free,
                      step_p99_ms=10.0, draining=draining)


async def test_publish_list_and_expire(client: aioredis.Redis) -> None:
    await publish(client, info("a", 2), ttl_s=0.3)
    await publish(client, info("b", 1), ttl_s=30)
    assert {w.worker_id for w in await list_workers(client, "realtime")} == {"a", "b"}
    await asyncio.sleep(0.5)
    assert [w.worker_id for w in await list_workers(client, "realtime")] == ["b"]


async def test_mixed_workers_serve_streams_and_remove(client: aioredis.Redis) -> None:
    await publish(client, info("m", 1, lane="mixed"), ttl_s=30)
    await publish(client, info("batch-1", 0, 0, lane="batch"), ttl_s=30)
    assert [w.lane for w in await list_workers(client, "realtime")] == ["mixed"]
    await registry.remove(client, "m", "mixed")
    assert await list_workers(client, "realtime") == []
    assert [w.worker_id for w in await list_workers(client, "batch")] == ["batch-1"]


def test_pick_least_loaded_with_a_free_slot() -> None:
    workers = [info("full", 0), info("busy", 1), info("idle", 4), info("draining", 4,
                                                                        draining=True)]
    assert pick_worker(workers) is not None
    assert pick_worker(workers).worker_id == "idle"  # type: ignore[union-attr]
    assert pick_worker(workers, exclude=frozenset({"idle"})).worker_id == "busy"  # type: ignore[union-attr]
    assert pick_worker([info("full", 0)]) is None
