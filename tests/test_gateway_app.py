"""The gateway application in-process (``create_app`` on a real 127.0.0.1 port):
JSON errors, Redis down -> 503 + Retry-After and recovery, readiness, and the
shutdown drain of open streams. Real redis-server; the realtime worker is the
real ``RealtimeWorker`` with the simulated engine (no speech needed here)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from aiohttp import web
from conftest import RedisServer, free_port

from engines.simulated import SimulatedEngine
from gateway.app import create_app
from lanegate.settings import Settings
from lanes import registry
from workers.realtime import RealtimeWorker

Gateway = Callable[..., Awaitable[tuple[str, web.AppRunner]]]


@pytest_asyncio.fixture
async def gateway(redis_server: RedisServer) -> AsyncIterator[Gateway]:
    runners: list[web.AppRunner] = []

    async def start(**changes: Any) -> tuple[str, web.AppRunner]:
        settings = Settings(redis_url=redis_server.url, **changes)
        runner = web.AppRunner(create_app(settings), shutdown_timeout=10)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}", runner

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest_asyncio.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest_asyncio.fixture
async def sim_worker(redis_client: aioredis.Redis) -> AsyncIterator[RealtimeWorker]:
    settings = Settings(engine="simulated", worker_id="sim-1", heartbeat_s=0.2)
    worker = RealtimeWorker(settings, SimulatedEngine(settings, slots=2), redis_client)
    await worker.start()
    yield worker
    if not worker.draining:
        await worker.stop()


async def request(method: str, url: str, **kwargs: Any
                  ) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with aiohttp.ClientSession() as http, http.request(method, url, **kwargs) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


async def test_every_http_error_is_json(gateway: Gateway) -> None:
    base, _ = await gateway()
    status, body, _ = await request("GET", base + "/nope")
    assert (status, body["error"]["code"]) == (404, "not_found")
    status, body, headers = await request("POST", base + "/healthz")
    assert (status, body["error"]["code"]) == (405, "method_not_allowed")
    assert "GET" in headers["Allow"]
    status, body, _ = await request("GET", base + "/v1/stream")
    assert (status, body["error"]["code"]) == (426, "bad_request")
    assert set(body["error"]) == {"code", "message"}


async def test_redis_down_is_503_with_retry_after_and_recovers(
    gateway: Gateway, redis_server: RedisServer
) -> None:
    base, _ = await gateway()
    status, _, _ = await request("GET", base + "/v1/transcriptions")
    assert status == 200
    redis_server.kill()
    status, body, headers = await request("GET", base + "/v1/transcriptions")
    assert status == 503
    assert body["error"]["code"] == "unavailable"
    assert int(headers["Retry-After"]) >= 1
    status, body, _ = await request("GET", base + "/readyz")
    assert (status, body["reason"]) == (503, "redis_unreachable")
    assert (await request("GET", base + "/healthz"))[0] == 200
    redis_server.start()
    status, _, _ = await request("GET", base + "/v1/transcriptions")
    assert status == 200


async def test_readyz_needs_a_live_realtime_worker(
    gateway: Gateway, redis_client: aioredis.Redis
) -> None:
    base, _ = await gateway()
    status, body, _ = await request("GET", base + "/readyz")
    assert (status, body["reason"]) == (503, "no_realtime_worker")
    info = registry.WorkerInfo(worker_id="w1", lane="realtime", url="http://127.0.0.1:1",
                               engine="simulated", slots_total=4, slots_free=3,
                               step_p99_ms=1.0)
    await registry.publish(redis_client, info, ttl_s=30)
    status, body, _ = await request("GET", base + "/readyz")
    assert status == 200
    assert body == {"status": "ready", "realtime_workers": 1, "free_slots": 3}
    await registry.publish(redis_client, registry.WorkerInfo(**{**info.__dict__,
                                                                "draining": True}), ttl_s=30)
    assert (await request("GET", base + "/readyz"))[0] == 503


async def test_no_realtime_worker_is_overloaded_1013(gateway: Gateway) -> None:
    base, _ = await gateway()
    async with aiohttp.ClientSession() as http, http.ws_connect(
        base.replace("http", "ws") + "/v1/stream") as ws:
        event = await ws.receive_json(timeout=10)
        assert event["type"] == "error"
        assert event["code"] == "overloaded"
        assert "no realtime worker" in event["message"]
        assert (await ws.receive(timeout=10)).type is aiohttp.WSMsgType.CLOSE
        assert ws.close_code == 1013


async def test_unreachable_registry_entry_is_skipped(
    gateway: Gateway, redis_client: aioredis.Redis, sim_worker: RealtimeWorker
) -> None:
    base, _ = await gateway()
    dead = registry.WorkerInfo(worker_id="a-dead", lane="realtime",
                               url=f"http://127.0.0.1:{free_port()}", engine="simulated",
                               slots_total=100, slots_free=100, step_p99_ms=0.0)
    await registry.publish(redis_client, dead, ttl_s=30)  # least loaded: tried first
    async with aiohttp.ClientSession() as http, http.ws_connect(
        base.replace("http", "ws") + "/v1/stream") as ws:
        ready = await ws.receive_json(timeout=10)
        assert ready["type"] == "ready", ready
        await ws.send_str('{"type":"end"}')
        assert (await ws.receive_json(timeout=10)) == {"type": "done"}


async def test_gateway_shutdown_drains_open_streams_with_1001(
    gateway: Gateway, sim_worker: RealtimeWorker
) -> None:
    base, runner = await gateway()
    events: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as http, http.ws_connect(
        base.replace("http", "ws") + "/v1/stream") as ws:
        assert (await ws.receive_json(timeout=10))["type"] == "ready"
        await ws.send_bytes(b"\x10\x00" * 16000)  # 1 s of (simulated-engine) audio

        async def read() -> None:
            async for msg in ws:
                if msg.type is aiohttp.WSMsgType.TEXT:
                    events.append(json.loads(msg.data))

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.3)
        await runner.cleanup()
        await asyncio.wait_for(reader, 15)
        assert events[-1] == {"type": "done"}, events
        assert ws.close_code == 1001


@pytest.mark.parametrize("lane", ["realtime", "mixed"])
def test_silence_limit_per_lane(lane: str) -> None:
    from gateway.workers_client import silence_limit_s

    settings = Settings()
    limit = silence_limit_s(settings, lane)
    if lane == "mixed":
        assert limit == settings.mixed_lost_timeout_s
    else:
        assert limit < settings.worker_lost_timeout_s


async def test_stream_while_redis_is_down_is_overloaded_then_recovers(
    gateway: Gateway, redis_server: RedisServer, sim_worker: RealtimeWorker
) -> None:
    base, _ = await gateway()
    url = base.replace("http", "ws") + "/v1/stream"
    redis_server.kill()
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url) as ws:
            event = await ws.receive_json(timeout=10)
            assert (event["type"], event["code"]) == ("error", "overloaded")
            await ws.receive(timeout=10)
            assert ws.close_code == 1013
        redis_server.start()
        for _ in range(100):  # the worker's next heartbeat re-registers it
            if (await request("GET", base + "/readyz"))[0] == 200:
                break
            await asyncio.sleep(0.1)
        async with http.ws_connect(url) as ws:
            assert (await ws.receive_json(timeout=10))["type"] == "ready"
