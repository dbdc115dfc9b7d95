"""API keys, tenants and the per-key session leases: a real aiohttp server on
127.0.0.1 with a route that calls ``tenant_of``, a real HTTP client, and a real
redis-server for the lease counts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from aiohttp import web
from conftest import RedisServer, free_port

from gateway.auth import (
    ANONYMOUS,
    acquire_session,
    lease_member,
    leases_ctx,
    live_sessions,
    refresh_sessions,
    release_session,
    tenant_id,
    tenant_of,
)
from gateway.errors import error_middleware
from gateway.state import GATEWAY_ID, LEASES, REDIS, SETTINGS
from lanegate.constants import GATEWAY_KEY
from lanegate.settings import Settings

Serve = Callable[[Settings], Awaitable[str]]


async def whoami(request: web.Request) -> web.Response:
    return web.json_response({"tenant": tenant_of(request)})


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(settings: Settings) -> str:
        app = web.Application(middlewares=[error_middleware])
        app[SETTINGS] = settings
        app.router.add_get("/whoami", whoami)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}/whoami"

    yield start
    for runner in runners:
        await runner.cleanup()


async def fetch(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_auth_off_everyone_is_anonymous(serve: Serve) -> None:
    url = await serve(Settings(api_keys=""))
    assert await fetch(url) == (200, {"tenant": ANONYMOUS})
    assert await fetch(url, {"Authorization": "Bearer whatever"}) == (200, {"tenant": ANONYMOUS})


async def test_bearer_header_and_query_key_give_the_same_tenant(serve: Serve) -> None:
    url = await serve(Settings(api_keys="k1, k2"))
    by_header = await fetch(url, {"Authorization": "Bearer k1"})
    by_query = await fetch(url + "?api_key=k1")
    assert by_header == by_query == (200, {"tenant": tenant_id("k1")})
    assert (await fetch(url, {"Authorization": "bearer k2"}))[1] == {"tenant": tenant_id("k2")}
    assert tenant_id("k1") != tenant_id("k2")
    assert "k1" not in tenant_id("k1")


@pytest.mark.parametrize("headers", [None, {"Authorization": "Bearer nope"},
                                     {"Authorization": "Basic k1"}, {"Authorization": "Bearer"}])
async def test_missing_or_wrong_key_is_a_json_401(serve: Serve,
                                                  headers: dict[str, str] | None) -> None:
    url = await serve(Settings(api_keys="k1"))
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as resp:
        assert resp.status == 401
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        assert await resp.json() == {
            "error": {"code": "unauthorized", "message": "missing or invalid API key"}}


async def test_session_leases_limit_a_key_across_gateways(redis_server: RedisServer) -> None:
    settings = Settings(api_keys="k", max_sessions_per_key=2, session_lease_s=30)
    tenant = tenant_id("k")
    # two clients stand for two gateway replicas sharing one Redis
    one = aioredis.Redis.from_url(redis_server.url)
    two = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await acquire_session(one, settings, tenant, "s1")
        assert await acquire_session(two, settings, tenant, "s2")
        assert not await acquire_session(one, settings, tenant, "s3")
        assert await acquire_session(two, settings, tenant_id("other"), "s4")
        await refresh_sessions(one, settings, {tenant: ["s1"]})  # a live lease stays counted
        assert await live_sessions(one, tenant) == 2
        await release_session(two, settings, tenant, "s1")
        assert await acquire_session(two, settings, tenant, "s3")
    finally:
        await one.aclose()
        await two.aclose()


async def test_a_dead_gateways_leases_expire(redis_server: RedisServer) -> None:
    settings = Settings(api_keys="k", max_sessions_per_key=1, session_lease_s=0.2)
    tenant = tenant_id("k")
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await acquire_session(client, settings, tenant, "crashed")
        assert not await acquire_session(client, settings, tenant, "next")
        await asyncio.sleep(0.4)  # nobody refreshed "crashed"
        assert await acquire_session(client, settings, tenant, "next")
    finally:
        await client.aclose()


async def test_the_sessions_of_a_gateway_whose_heartbeat_stopped_stop_counting(
        redis_server: RedisServer) -> None:
    """A killed gateway cannot release its leases: they stop counting when its heartbeat
    expires (``gateway_lease_s``), long before the session lease, so its clients'
    reconnects through another (or a restarted) gateway are admitted."""
    settings = Settings(api_keys="k", max_sessions_per_key=1, session_lease_s=30,
                        gateway_lease_s=0.3)
    tenant = tenant_id("k")
    client = aioredis.Redis.from_url(redis_server.url)
    apps = {}
    for name in ("live", "killed"):
        app = web.Application()
        app[REDIS], app[SETTINGS], app[GATEWAY_ID] = client, settings, name
        apps[name] = app
    heartbeat = leases_ctx(apps["live"])
    try:
        await anext(heartbeat)
        # the killed gateway's last heartbeat: nobody refreshes it again
        await client.set(GATEWAY_KEY.format(gateway_id="killed"), "1", px=300)
        assert await acquire_session(client, settings, tenant, lease_member(apps["killed"], "a"))
        assert not await acquire_session(client, settings, tenant,
                                         lease_member(apps["live"], "b"))
        await asyncio.sleep(0.5)
        assert await acquire_session(client, settings, tenant, lease_member(apps["live"], "b"))
        await asyncio.sleep(0.5)  # the live gateway's heartbeat keeps its session counted
        assert not await acquire_session(client, settings, tenant,
                                         lease_member(apps["live"], "c"))
        assert await anext(heartbeat, None) is None  # a clean exit deletes the heartbeat
        assert not await client.exists(GATEWAY_KEY.format(gateway_id="live"))
        assert await acquire_session(client, settings, tenant, lease_member(apps["live"], "c"))
    finally:
        await heartbeat.aclose()
        await client.aclose()


async def test_a_gateway_keeps_its_streams_leases_until_it_releases_them(
        redis_server: RedisServer) -> None:
    """One refresh per gateway keeps every live stream's lease: past several lease
    lengths both still count; a released one stops counting and is not added back."""
    settings = Settings(api_keys="k", max_sessions_per_key=2, max_key_share=1.0,
                        session_lease_s=2.0)
    tenant = tenant_id("k")
    client = aioredis.Redis.from_url(redis_server.url)
    app = web.Application()
    app[REDIS], app[SETTINGS], app[GATEWAY_ID] = client, settings, "gw"
    keeper = leases_ctx(app)
    try:
        await anext(keeper)
        leases = app[LEASES]
        assert await leases.admit(tenant, "gw/a") is None
        assert await leases.admit(tenant, "gw/b") is None
        assert await leases.admit(tenant, "gw/c") == 2
        await asyncio.sleep(5.0)  # two and a half leases; refreshed every 0.67 s
        assert await live_sessions(client, tenant) == 2
        await leases.release(tenant, "gw/a")
        await asyncio.sleep(1.0)  # a refresh or more since
        assert await live_sessions(client, tenant) == 1
        assert await leases.admit(tenant, "gw/c") is None
    finally:
        await keeper.aclose()
        await client.aclose()


async def test_anonymous_and_unlimited_are_not_counted(redis_server: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        off = Settings(max_sessions_per_key=1)
        assert await acquire_session(client, off, ANONYMOUS, "a")
        assert await acquire_session(client, off, ANONYMOUS, "b")
        unlimited = Settings(api_keys="k", max_sessions_per_key=0)
        assert await acquire_session(client, unlimited, tenant_id("k"), "a")
        assert await acquire_session(client, unlimited, tenant_id("k"), "b")
        assert await client.keys("lanegate:sessions:*") == []
    finally:
        await client.aclose()
