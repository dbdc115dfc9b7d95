"""lanegate/webhooks.py: signed, retried, durable webhook delivery, against a real
redis-server, real batch consumers and a local aiohttp receiver."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp import web
from conftest import RedisServer, free_port

from lanegate.blobs import new_id
from lanegate.constants import WEBHOOK_DUE_KEY, WEBHOOK_KEY
from lanegate.settings import Settings
from lanegate.webhooks import (
    ATTEMPT_HEADER,
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    WebhookDispatcher,
    backoff_s,
    body_for,
    sign,
    verify,
)
from lanes.jobs import JobStore
from lanes.queue import redis_client
from workers.batch import BatchConsumer
from workers.engines import create_engine

SECRET = "s3cret"


@dataclass
class Receiver:
    """A webhook endpoint that answers ``fail_first`` requests with 500."""

    port: int
    fail_first: int = 0
    requests: list[tuple[bytes, dict[str, str]]] = field(default_factory=list)
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def start(self) -> None:
        async def hook(request: web.Request) -> web.Response:
            self.requests.append((await request.read(), dict(request.headers)))
            if len(self.requests) <= self.fail_first:
                return web.Response(status=500, text="not yet")
            return web.Response(status=204)

        app = web.Application()
        app.router.add_post("/hook", hook)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def received(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.requests) < n:
            assert time.monotonic() < deadline, f"only {len(self.requests)} of {n} requests"
            await asyncio.sleep(0.02)


@pytest.fixture
async def receiver_factory() -> AsyncIterator[Callable[..., Receiver]]:
    made: list[Receiver] = []

    def make(fail_first: int = 0, port: int | None = None) -> Receiver:
        receiver = Receiver(port or free_port(), fail_first)
        made.append(receiver)
        return receiver

    yield make
    for receiver in made:
        await receiver.stop()


class Env:
    def __init__(self, settings: Settings, client: aioredis.Redis) -> None:
        self.settings = settings
        self.redis = client
        self.store = JobStore(client, settings)
        self._running: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def submit(self, pcm: bytes, url: str) -> str:
        job_id = new_id()
        self.store.blobs.path(job_id).write_bytes(pcm)
        job, _ = await self.store.submit(job_id=job_id, tenant="t1",
                                         audio_seconds=len(pcm) / 32000, webhook_url=url)
        return job.id

    def consume(self) -> asyncio.Event:
        """Start a batch consumer (which runs the dispatcher); returns its stop event."""
        engine = create_engine(self.settings, slots=0)
        consumer = BatchConsumer(self.settings, self.redis, engine,
                                 worker_id=f"c{len(self._running)}")
        stop = asyncio.Event()
        self._running.append((stop, asyncio.create_task(consumer.run(stop))))
        return stop

    async def stop_all(self) -> None:
        for stop, _ in self._running:
            stop.set()
        await asyncio.gather(*(task for _, task in self._running))
        self._running.clear()

    async def pending_deliveries(self) -> int:
        return int(await self.redis.zcard(WEBHOOK_DUE_KEY))


@pytest.fixture
async def env_factory(redis_server: RedisServer,
                      tmp_path: Path) -> AsyncIterator[Callable[..., Env]]:
    made: list[Env] = []

    def make(**overrides: Any) -> Env:
        base: dict[str, Any] = {"engine": "simulated", "webhook_secret": SECRET,
                                "webhook_backoff_s": 0.05, "webhook_timeout_s": 2.0}
        settings = Settings(redis_url=redis_server.url, blob_dir=str(tmp_path / "blobs"),
                            **{**base, **overrides})
        env = Env(settings, redis_client(settings.redis_url))
        made.append(env)
        return env

    yield make
    for env in made:
        await env.stop_all()
        await env.redis.aclose()


SPEECHLIKE = (b"\x00\x10\x00\xf0" * 8000) * 2  # 2 s of a loud square wave


def test_signature_is_hmac_sha256_of_the_exact_body() -> None:
    body = body_for("abc", "completed")
    assert json.loads(body) == {"id": "abc", "status": "completed"}
    header = sign(body, SECRET)
    assert header.startswith("sha256=")
    assert len(header) == len("sha256=") + 64
    assert verify(body, SECRET, header)
    assert not verify(body + b" ", SECRET, header)
    assert not verify(body, "other", header)


def test_backoff_doubles_from_the_setting() -> None:
    settings = Settings(webhook_backoff_s=0.5)
    assert [backoff_s(settings, n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_s(settings, 100) == 3600.0


async def test_completion_is_posted_signed_and_retried_until_2xx(
    env_factory: Callable[..., Env], receiver_factory: Callable[..., Receiver],
) -> None:
    env = env_factory()
    receiver = receiver_factory(fail_first=2)
    await receiver.start()
    job_id = await env.submit(SPEECHLIKE, receiver.url)
    env.consume()
    await receiver.received(3)
    for attempt, (body, headers) in enumerate(receiver.requests, start=1):
        assert json.loads(body) == {"id": job_id, "status": "completed"}
        assert verify(body, SECRET, headers[SIGNATURE_HEADER])
        assert headers[DELIVERY_HEADER] == job_id
        assert headers[ATTEMPT_HEADER] == str(attempt)
        assert headers["Content-Type"] == "application/json"
    await _until(lambda: env.pending_deliveries(), 0)
    assert await env.redis.exists(WEBHOOK_KEY.format(job_id=job_id)) == 0
    await asyncio.sleep(0.3)
    assert len(receiver.requests) == 3  # nothing after the 2xx
    job = await env.store.get(job_id, "t1")
    assert job is not None
    assert job.status == "completed"


async def test_failure_is_posted_too(
    env_factory: Callable[..., Env], receiver_factory: Callable[..., Receiver],
) -> None:
    env = env_factory()
    receiver = receiver_factory()
    await receiver.start()
    job_id = await env.submit(b"\x01\x02\x03", receiver.url)  # poison: fails at once
    env.consume()
    await receiver.received(1)
    body, headers = receiver.requests[0]
    assert json.loads(body) == {"id": job_id, "status": "failed"}
    assert verify(body, SECRET, headers[SIGNATURE_HEADER])


async def test_delivery_gives_up_after_max_attempts_and_never_touches_the_job(
    env_factory: Callable[..., Env], receiver_factory: Callable[..., Receiver],
) -> None:
    env = env_factory(webhook_max_attempts=3, webhook_backoff_s=0.02)
    receiver = receiver_factory(fail_first=1000)
    await receiver.start()
    job_id = await env.submit(SPEECHLIKE, receiver.url)
    env.consume()
    await receiver.received(3)
    await _until(lambda: env.pending_deliveries(), 0)
    await asyncio.sleep(0.3)
    assert len(receiver.requests) == 3
    job = await env.store.get(job_id, "t1")
    assert job is not None
    assert (job.status, job.error) == ("completed", None)
    assert await env.store.result(job_id, "t1") is not None


async def test_deliveries_survive_a_worker_restart(
    env_factory: Callable[..., Env], receiver_factory: Callable[..., Receiver],
) -> None:
    env = env_factory(webhook_max_attempts=1000)
    receiver = receiver_factory()  # not listening yet: connection refused
    job_id = await env.submit(SPEECHLIKE, receiver.url)
    env.consume()
    key = WEBHOOK_KEY.format(job_id=job_id)
    await _until(lambda: _attempts(env.redis, key), lambda n: n >= 2)
    await env.stop_all()  # the worker goes away with the webhook undelivered
    await receiver.start()
    env.consume()  # a new worker picks the delivery up from Redis
    await receiver.received(1)
    body, headers = receiver.requests[0]
    assert json.loads(body) == {"id": job_id, "status": "completed"}
    assert int(headers[ATTEMPT_HEADER]) >= 3


async def test_unsigned_when_no_secret_is_set(
    env_factory: Callable[..., Env], receiver_factory: Callable[..., Receiver],
) -> None:
    env = env_factory(webhook_secret="")
    receiver = receiver_factory()
    await receiver.start()
    await env.submit(SPEECHLIKE, receiver.url)
    env.consume()
    await receiver.received(1)
    assert SIGNATURE_HEADER not in receiver.requests[0][1]


async def test_dispatcher_alone_delivers_what_is_due(
    env_factory: Callable[..., Env], receiver_factory: Callable[..., Receiver],
) -> None:
    env = env_factory()
    receiver = receiver_factory()
    await receiver.start()
    key = WEBHOOK_KEY.format(job_id="j1")
    await env.redis.hset(key, mapping={"job_id": "j1", "url": receiver.url,
                                       "status": "completed", "attempts": "0"})
    await env.redis.zadd(WEBHOOK_DUE_KEY, {"j1": time.time() + 3600})  # not due yet
    dispatcher = WebhookDispatcher(env.redis, env.settings)
    try:
        assert await dispatcher.deliver_due() == 0
        await env.redis.zadd(WEBHOOK_DUE_KEY, {"j1": time.time()})
        assert await dispatcher.deliver_due() == 1
    finally:
        await dispatcher.close()
    assert len(receiver.requests) == 1
    assert await env.pending_deliveries() == 0


async def _attempts(client: aioredis.Redis, key: str) -> int:
    raw = await client.hget(key, "attempts")
    return int(raw) if raw else 0


async def _until(read: Callable[[], Awaitable[Any]], want: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await read()
        if (want(value) if callable(want) else value == want):
            return
        assert time.monotonic() < deadline, f"last value {value!r}"
        await asyncio.sleep(0.02)
