"""lanegate/webhooks.py: signed, retried, durable webhook delivery, against a real
redis-server, real batch consumers and a local aiohttp receiver. Every request goes
to loopback: the receiver is allowed with ``webhook_allow_private``; the address
policy for every other class is checked without traffic (tests/test_addresses.py)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
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

from engines import create_engine
from lanegate.addresses import IPAddress
from lanegate.blobs import new_id
from lanegate.constants import WEBHOOK_DUE_KEY, WEBHOOK_KEY
from lanegate.redis_io import redis_client
from lanegate.settings import Settings
from lanegate.webhooks import (
    ATTEMPT_HEADER,
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    Lookup,
    WebhookDispatcher,
    WebhookRefused,
    body_for,
    check_webhook_url,
    sign,
    verify_signature,
)
from lanes.jobs import JobStore
from workers.batch import BatchConsumer

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

    async def until_status(self, job_id: str, status: str) -> None:
        async def read() -> str | None:
            job = await self.store.get(job_id, "t1")
            return None if job is None else job.status

        await _until(read, status)

    async def due(self, job_id: str, url: str) -> None:
        """A delivery due now, as the completion script writes it."""
        await self.redis.hset(WEBHOOK_KEY.format(job_id=job_id), mapping={
            "job_id": job_id, "url": url, "status": "completed", "attempts": "0"})
        await self.redis.zadd(WEBHOOK_DUE_KEY, {job_id: time.time()})


@pytest.fixture
async def env_factory(redis_server: RedisServer,
                      tmp_path: Path) -> AsyncIterator[Callable[..., Env]]:
    made: list[Env] = []

    def make(**overrides: Any) -> Env:
        base: dict[str, Any] = {"engine": "simulated", "webhook_secret": SECRET,
                                "webhook_backoff_s": 0.05, "webhook_timeout_s": 2.0,
                                "webhook_allow_private": True}
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


def test_signature_is_a_timestamped_hmac_sha256_of_the_exact_body() -> None:
    body = body_for("abc", "completed")
    assert json.loads(body) == {"id": "abc", "status": "completed"}
    now = int(time.time())
    header = sign(body, SECRET, now)
    digest = hmac.new(SECRET.encode(), f"{now}.".encode() + body, hashlib.sha256).hexdigest()
    assert header == f"t={now},v1={digest}"
    assert verify_signature(SECRET, header, body)
    assert not verify_signature(SECRET, header, body + b" ")
    assert not verify_signature("other", header, body)


def test_a_captured_delivery_cannot_be_replayed_later() -> None:
    body = body_for("abc", "completed")
    sent_at = int(time.time()) - 3600
    header = sign(body, SECRET, sent_at)
    assert verify_signature(SECRET, header, body, tolerance_s=300, now=sent_at + 299)
    assert not verify_signature(SECRET, header, body, tolerance_s=300, now=sent_at + 301)
    assert not verify_signature(SECRET, header, body)  # an hour late at the default 300 s
    # moving the timestamp forward breaks the HMAC, which covers it
    forged = header.replace(f"t={sent_at}", f"t={int(time.time())}")
    assert not verify_signature(SECRET, forged, body)


@pytest.mark.parametrize("header", [
    "", "sha256=abc", "t=,v1=", "v1=" + "0" * 64, "t=123", "t=12x,v1=" + "0" * 64,
    "t=١٢٣,v1=" + "0" * 64,
])
def test_malformed_signature_headers_do_not_verify(header: str) -> None:
    assert not verify_signature(SECRET, header, b"{}")


def test_any_v1_value_may_match() -> None:
    body, now = b"{}", int(time.time())
    right = sign(body, SECRET, now).split(",")[1]
    assert verify_signature(SECRET, f"t={now},v1={'0' * 64},{right}", body)


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
        assert verify_signature(SECRET, headers[SIGNATURE_HEADER], body)
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
    assert verify_signature(SECRET, headers[SIGNATURE_HEADER], body)


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


async def test_nothing_is_sent_without_a_secret_and_a_worker_with_one_delivers_it(
    env_factory: Callable[..., Env], receiver_factory: Callable[..., Receiver],
) -> None:
    env = env_factory(webhook_secret="")
    receiver = receiver_factory()
    await receiver.start()
    job_id = await env.submit(SPEECHLIKE, receiver.url)
    env.consume()
    await env.until_status(job_id, "completed")
    assert await env.pending_deliveries() == 1
    await asyncio.sleep(1.0)  # five dispatcher polls
    assert receiver.requests == []  # never unsigned
    assert await _attempts(env.redis, WEBHOOK_KEY.format(job_id=job_id)) == 0
    await env.stop_all()
    signed = env_factory()  # same Redis: the delivery waited there
    signed.consume()
    await receiver.received(1)
    body, headers = receiver.requests[0]
    assert json.loads(body) == {"id": job_id, "status": "completed"}
    assert verify_signature(SECRET, headers[SIGNATURE_HEADER], body)


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


# --- where a delivery may go ---------------------------------------------------------


async def test_loopback_in_every_spelling_is_refused_at_delivery(
    env_factory: Callable[..., Env], receiver_factory: Callable[..., Receiver],
) -> None:
    # the refused attempts are retried an hour later: not during this test
    env = env_factory(webhook_allow_private=False, webhook_backoff_s=3600.0)
    receiver = receiver_factory()
    await receiver.start()
    port = receiver.port
    spellings = [f"http://{host}:{port}/hook" for host in (
        "127.0.0.1", "localhost", "LOCALHOST.", "2130706433", "0x7f.1", "0177.0.0.1",
        "127.1", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "[::1]", "0.0.0.0")]
    for n, url in enumerate(spellings):
        await env.due(f"j{n}", url)
    dispatcher = WebhookDispatcher(env.redis, env.settings)
    try:
        assert await dispatcher.deliver_due() == len(spellings)
    finally:
        await dispatcher.close()
    assert receiver.requests == []
    for n in range(len(spellings)):
        # a failed attempt, rescheduled with backoff
        assert await _attempts(env.redis, WEBHOOK_KEY.format(job_id=f"j{n}")) == 1, spellings[n]

    # the receiver is reachable: with the allow-list the same dispatcher code delivers
    allowed = WebhookDispatcher(env.redis, env.settings.replace(webhook_allow_private=True))
    await env.due("ok", receiver.url)
    try:
        await allowed.deliver_due()
    finally:
        await allowed.close()
    assert len(receiver.requests) == 1
    assert json.loads(receiver.requests[0][0])["id"] == "ok"


async def test_one_lookup_per_delivery_and_the_connection_goes_to_the_checked_address(
    env_factory: Callable[..., Env], receiver_factory: Callable[..., Receiver],
) -> None:
    """DNS rebinding: the name answers loopback (allowed here) the first time and the
    metadata address after; the check and the connection share one answer."""
    env = env_factory(webhook_allow_private=True, webhook_backoff_s=3600.0)
    receiver = receiver_factory()
    await receiver.start()
    answers = [["127.0.0.1"], ["169.254.169.254"], ["127.0.0.1"]]
    lookups: list[str] = []

    async def rebinding(host: str, port: int) -> list[IPAddress]:
        lookups.append(host)
        return [ipaddress.ip_address(a) for a in answers[min(len(lookups), 3) - 1]]

    dispatcher = WebhookDispatcher(env.redis, env.settings, lookup=rebinding)
    url = f"http://hooks.example.test:{receiver.port}/hook"
    try:
        await env.due("first", url)
        assert await dispatcher.deliver_due() == 1
        assert lookups == ["hooks.example.test"]
        assert len(receiver.requests) == 1
        # the name, not the address, is what the receiver sees (virtual hosts, TLS SNI)
        assert receiver.requests[0][1]["Host"] == f"hooks.example.test:{receiver.port}"

        await env.due("second", url)  # now the name points at the metadata service
        assert await dispatcher.deliver_due() == 1
        assert lookups == ["hooks.example.test"] * 2  # resolved again, not cached
        assert len(receiver.requests) == 1
        assert await _attempts(env.redis, WEBHOOK_KEY.format(job_id="second")) == 1
    finally:
        await dispatcher.close()


async def test_a_redirect_is_a_failed_attempt_and_not_followed(
    env_factory: Callable[..., Env], serve: Callable[..., Awaitable[int]],
) -> None:
    env = env_factory()
    followed: list[str] = []

    async def hook(request: web.Request) -> web.Response:
        raise web.HTTPFound("/internal")

    async def internal(request: web.Request) -> web.Response:
        followed.append(request.method)
        return web.Response(status=204)

    port = await serve(("POST", "/hook", hook), ("*", "/internal", internal))
    await env.due("j", f"http://127.0.0.1:{port}/hook")
    dispatcher = WebhookDispatcher(env.redis, env.settings)
    try:
        await dispatcher.deliver_due()
    finally:
        await dispatcher.close()
    assert followed == []
    assert await _attempts(env.redis, WEBHOOK_KEY.format(job_id="j")) == 1
    assert await env.pending_deliveries() == 1


async def test_only_a_bounded_response_is_read(
    env_factory: Callable[..., Env], serve: Callable[..., Awaitable[int]],
) -> None:
    """A receiver that answers 200 and then streams without end: the delivery counts
    as done after webhook_max_response_bytes, not after webhook_timeout_s of reading."""
    env = env_factory(webhook_timeout_s=5.0, webhook_max_response_bytes=1024)
    streamed = [0]

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200)
        await resp.prepare(request)
        chunk = b"x" * 65536
        with contextlib.suppress(ConnectionError):
            while streamed[0] < 1 << 30:
                await resp.write(chunk)
                streamed[0] += len(chunk)
        return resp

    port = await serve(("POST", "/hook", endless))
    await env.due("j", f"http://127.0.0.1:{port}/hook")
    dispatcher = WebhookDispatcher(env.redis, env.settings)
    try:
        await dispatcher.deliver_due()
    finally:
        await dispatcher.close()
    assert await env.pending_deliveries() == 0  # delivered at the first attempt
    assert await env.redis.exists(WEBHOOK_KEY.format(job_id="j")) == 0
    assert streamed[0] < 1 << 30


# --- the check at submit ----------------------------------------------------------------


def _answers(*addresses: str) -> Lookup:
    async def lookup(host: str, port: int) -> list[IPAddress]:
        return [ipaddress.ip_address(a) for a in addresses]

    return lookup


async def test_check_at_submit_resolves_and_applies_the_policy() -> None:
    settings = Settings(webhook_secret=SECRET)
    public = _answers("93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946")
    await check_webhook_url("https://hooks.example.com/x", settings, lookup=public)
    for lookup, reason in ((_answers("10.0.0.7"), "10.0.0.7 is private"),
                           (_answers("93.184.216.34", "169.254.169.254"),
                            "169.254.169.254 is link-local"),
                           (_answers(), "resolves to no address")):
        with pytest.raises(WebhookRefused, match=reason):
            await check_webhook_url("https://hooks.example.com/x", settings, lookup=lookup)
    # literals and localhost names are judged without any lookup
    for url in ("http://2130706433/", "http://[::ffff:169.254.169.254]/", "http://localhost./",
                "http://0.0.0.0:8080/", "http://224.0.0.1/"):
        with pytest.raises(WebhookRefused):
            await check_webhook_url(url, settings, lookup=public)


async def test_check_at_submit_with_the_system_resolver() -> None:
    settings = Settings(webhook_secret=SECRET)
    with pytest.raises(WebhookRefused, match="loopback"):
        await check_webhook_url("http://localhost:8080/hook", settings)
    allowed = settings.replace(webhook_allow_private=True)
    await check_webhook_url("http://localhost:8080/hook", allowed)  # /etc/hosts: 127.0.0.1
    with pytest.raises(WebhookRefused, match="does not resolve"):
        await check_webhook_url("http://no-such-host.invalid/hook", allowed)


async def test_a_lookup_that_hangs_is_refused_after_the_timeout() -> None:
    async def hangs(host: str, port: int) -> list[IPAddress]:
        await asyncio.sleep(3600)
        return []

    settings = Settings(webhook_secret=SECRET, webhook_timeout_s=0.1)
    with pytest.raises(WebhookRefused, match="did not resolve within"):
        await check_webhook_url("https://slow.example.com/", settings, lookup=hangs)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[int]]]:
    """``await serve((method, path, handler), ...)``: a loopback app; its port."""
    runners: list[web.AppRunner] = []

    async def start(*routes: tuple[str, str, Any]) -> int:
        app = web.Application()
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        runner = web.AppRunner(app, shutdown_timeout=1)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return port

    yield start
    for runner in runners:
        await runner.cleanup()


def test_the_readme_verification_snippet_accepts_ours_and_rejects_replays() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("Verify the raw body"):]
    code = section[section.index("```python") + len("```python"):section.index("```\n", 10)]
    namespace: dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), namespace)
    readme_verify = namespace["verify_signature"]
    body = body_for("abc", "completed")
    now = int(time.time())
    assert readme_verify(SECRET, sign(body, SECRET, now), body)
    assert not readme_verify(SECRET, sign(body, SECRET, now), body + b"x")
    assert not readme_verify("other", sign(body, SECRET, now), body)
    assert not readme_verify(SECRET, sign(body, SECRET, now - 3600), body)
