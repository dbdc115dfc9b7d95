"""API keys, tenants and the per-key concurrent stream limit.

A caller presents ``Authorization: Bearer <key>`` or ``?api_key=<key>``; the key
must be in ``settings.api_key_set``. With no keys configured auth is off and
every caller is the tenant ``"anonymous"``.

A tenant id is derived from the key (``key-`` + 16 hex digits of its SHA-256),
so keys themselves never appear in Redis key names, logs or metrics.

The per-key session limit is counted in Redis, so it holds across gateway
replicas: ``KEY_SESSIONS_KEY`` is a sorted set of the subject's live sessions
(``<gateway id>/<session id>``, :func:`lease_member`) scored by a lease expiry
(Redis server time). A gateway refreshes the leases of all its live streams
every ``session_lease_s / 3`` (``SessionLeases``). Each gateway keeps a
heartbeat key (``GATEWAY_KEY``, ``gateway_lease_s``): the sessions of a gateway
whose heartbeat is gone (it was killed, its host lost) stop counting within
``gateway_lease_s``, so its clients' reconnects (the OpenAI SDK's retry after a
dropped connection) are admitted at once, not after the session lease. The
limit is the lower of ``max_sessions_per_key`` and ``max_key_share`` of the live
realtime slots, so one key never holds every slot. The subject is the tenant;
with auth off (every caller ``anonymous``) it is the client's address
(``lease_subject``), so one client cannot take every slot either.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping

import redis.asyncio as aioredis
from aiohttp import web
from redis.exceptions import RedisError

from gateway.errors import json_error
from gateway.state import GATEWAY_ID, LEASES, REDIS, SETTINGS
from lanegate.constants import GATEWAY_KEY, KEY_SESSIONS_KEY
from lanegate.logs import get_logger
from lanegate.redis_io import ttl_ms
from lanegate.settings import Settings
from lanes.registry import list_workers

ANONYMOUS = "anonymous"
#: the limit when none applies (no per-key cap, and no slots known for the share)
NO_LIMIT = 2**31

# KEYS[1] = the tenant's set; ARGV = member, limit, lease_ms, the gateway key's prefix.
# Scores are expiry times in ms of Redis server time, so gateways' clocks do not matter.
# Only a new session that finds the subject at its limit walks the members for those
# of dead gateways (a refresh never does): the walk costs one EXISTS per member.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local function full()
  return redis.call('ZSCORE', KEYS[1], ARGV[1]) == false
     and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2])
end
if full() then
  for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    local gateway = string.match(member, '^([^/]+)/')
    if gateway and redis.call('EXISTS', ARGV[4] .. gateway) == 0 then
      redis.call('ZREM', KEYS[1], member)
    end
  end
  if full() then return 0 end
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""
# KEYS[1] = the subject's set; ARGV = lease_ms, then this gateway's live members in it
_REFRESH = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], expiry, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
return #ARGV - 1
"""


log = get_logger("gateway.auth")


def lease_member(app: web.Application, session_id: str) -> str:
    """A session's entry in the per-key count: it lives as long as this gateway does."""
    return f"{app[GATEWAY_ID]}/{session_id}"


class SessionLeases:
    """This gateway's live session leases: admitted and released one by one, refreshed
    all together, one script per subject in one round trip every ``session_lease_s /
    3`` (a timer and a Redis call per stream were a measurable share of the gateway's
    CPU at hundreds of streams)."""

    def __init__(self, redis: aioredis.Redis, settings: Settings) -> None:
        self._redis = redis
        self._settings = settings
        self._held: dict[str, set[str]] = {}  # subject -> members
        self._refreshed: asyncio.Event | None = None  # set when the refresh in flight ends

    async def admit(self, subject: str, member: str) -> int | None:
        """:func:`admit_session`, and the lease kept fresh until :meth:`release`."""
        at_limit = await admit_session(self._redis, self._settings, subject, member)
        if at_limit is None and _limited(self._settings, subject):
            self._held.setdefault(subject, set()).add(member)
        return at_limit

    async def release(self, subject: str, member: str) -> None:
        members = self._held.get(subject)
        if members is not None:
            members.discard(member)
            if not members:
                del self._held[subject]
        refreshed = self._refreshed
        if refreshed is not None:  # begun before the member left: it would add it back
            await refreshed.wait()
        await release_session(self._redis, self._settings, subject, member)

    async def refresh(self) -> None:
        held = {subject: list(members) for subject, members in self._held.items()}
        self._refreshed = refreshed = asyncio.Event()
        try:
            await refresh_sessions(self._redis, self._settings, held)
        finally:
            self._refreshed = None
            refreshed.set()


async def leases_ctx(app: web.Application) -> AsyncIterator[None]:
    """``cleanup_ctx``: this gateway's heartbeat key, set before the first session and
    refreshed every ``gateway_lease_s / 3`` (deleted at a clean exit, after the drain),
    and its sessions' leases (``app[LEASES]``), refreshed every ``session_lease_s / 3``."""
    settings = app[SETTINGS]
    key = GATEWAY_KEY.format(gateway_id=app[GATEWAY_ID])
    lease_ms = ttl_ms(settings.gateway_lease_s)
    leases = app[LEASES] = SessionLeases(app[REDIS], settings)

    async def beat() -> None:
        try:
            await app[REDIS].set(key, "1", px=lease_ms)
        except RedisError as exc:  # its sessions' leases still hold for session_lease_s
            log.warning("gateway_heartbeat_failed", error=str(exc))

    async def refresh() -> None:
        try:
            await leases.refresh()
        except RedisError as exc:  # the next round tries again, well within the lease
            log.warning("session_lease_refresh_failed", error=str(exc))

    async def every(period_s: float, action: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(period_s)
            await action()

    await beat()
    tasks = [asyncio.create_task(every(settings.gateway_lease_s / 3, beat)),
             asyncio.create_task(every(max(0.1, settings.session_lease_s / 3), refresh))]
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    with contextlib.suppress(RedisError):
        await app[REDIS].delete(key)


def api_key_of(request: web.Request) -> str | None:
    """The key the caller presented (header first, then query), or None."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.query.get("api_key") or None


def tenant_id(key: str) -> str:
    """Stable, non-secret id of an API key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def auth_enabled(settings: Settings) -> bool:
    return bool(settings.api_key_set)


def authenticate(request: web.Request, presented: str | None = None) -> str | None:
    """The caller's tenant, or None when auth is on and the key is missing or wrong.
    ``presented``: the key as another protocol carries it (default: ``api_key_of``)."""
    keys = request.app[SETTINGS].api_key_set
    if not keys:
        return ANONYMOUS
    if presented is None:
        presented = api_key_of(request)
    if presented is None:
        return None
    try:
        presented_bytes = presented.encode()
    except UnicodeEncodeError:  # a header that was not UTF-8 (kept as surrogates)
        return None
    # constant-time comparison against every configured key
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented_bytes, key.encode())
    return tenant_id(presented) if matched else None


def tenant_of(request: web.Request) -> str:
    """The caller's tenant; raises a JSON ``401`` for a missing or wrong key."""
    tenant = authenticate(request)
    if tenant is None:
        raise json_error(
            401, "unauthorized", "missing or invalid API key",
            headers={"WWW-Authenticate": 'Bearer realm="lanegate"'},
        )
    return tenant


def lease_subject(request: web.Request, tenant: str) -> str:
    """Whose realtime sessions a new one counts against: the tenant, or with auth off
    the client's address (behind a proxy: the proxy's, so limit per client there)."""
    if tenant != ANONYMOUS:
        return tenant
    return address_subject(request.remote)


def address_subject(remote: str | None) -> str:
    """The lease subject of an anonymous caller at ``remote`` (its IP address): also a
    Wyoming connection's, which has no key (``gateway/wyoming.py``)."""
    return "addr-" + hashlib.sha256((remote or "unknown").encode()).hexdigest()[:16]


def _share_limited(settings: Settings) -> bool:
    return 0.0 < settings.max_key_share < 1.0


def _limited(settings: Settings, subject: str) -> bool:
    return subject != ANONYMOUS and (settings.max_sessions_per_key > 0
                                     or _share_limited(settings))


def session_limit(settings: Settings, live_slots: int | None) -> int:
    """Most realtime sessions one subject may hold: ``max_sessions_per_key`` and
    ``max_key_share`` of ``live_slots`` (when known), the lower; at least 1."""
    caps = [settings.max_sessions_per_key] if settings.max_sessions_per_key > 0 else []
    if live_slots is not None and _share_limited(settings):
        caps.append(max(1, math.floor(settings.max_key_share * live_slots)))
    return min(caps, default=NO_LIMIT)


async def live_slots(redis: aioredis.Redis) -> int:
    """Slots of the realtime workers that take sessions (registry, a heartbeat old)."""
    return sum(w.slots_total for w in await list_workers(redis, "realtime") if not w.draining)


async def acquire_session(
    redis: aioredis.Redis, settings: Settings, subject: str, member: str, *,
    limit: int | None = None,
) -> bool:
    """Count a new stream for ``subject``; False when it already holds ``limit``
    (default: ``max_sessions_per_key``; see :func:`session_limit`).

    ``member`` is :func:`lease_member`'s; calling it again for a live one
    refreshes its lease.
    """
    if not _limited(settings, subject):
        return True
    if limit is None:
        limit = session_limit(settings, None)
        if limit == NO_LIMIT:  # a share limit needs the live slots: admit_session
            return True
    result = await redis.register_script(_ACQUIRE)(
        keys=[KEY_SESSIONS_KEY.format(tenant=subject)],
        args=[member, limit, ttl_ms(settings.session_lease_s), GATEWAY_KEY.format(gateway_id="")])
    return bool(int(result))


async def admit_session(redis: aioredis.Redis, settings: Settings, subject: str,
                        member: str) -> int | None:
    """Count a new realtime session against ``subject``'s :func:`session_limit` over
    the live slots now; None when admitted, else the limit it is at."""
    limit = session_limit(settings, await live_slots(redis)
                          if _limited(settings, subject) and _share_limited(settings)
                          else None)
    if await acquire_session(redis, settings, subject, member, limit=limit):
        return None
    return limit


async def refresh_sessions(redis: aioredis.Redis, settings: Settings,
                           held: Mapping[str, Collection[str]]) -> None:
    """Extend the leases of live streams, ``{subject: members}`` as
    :meth:`SessionLeases.admit` took them (limited subjects only), in one round trip
    (call every ``session_lease_s / 3``); a lease that had lapsed counts again."""
    pipe = redis.pipeline(transaction=False)
    refresh = redis.register_script(_REFRESH)
    for subject, members in held.items():
        if members:
            await refresh(keys=[KEY_SESSIONS_KEY.format(tenant=subject)],
                          args=[ttl_ms(settings.session_lease_s), *members], client=pipe)
    if len(pipe):
        await pipe.execute()


async def release_session(
    redis: aioredis.Redis, settings: Settings, tenant: str, member: str
) -> None:
    """Stop counting a stream that ended."""
    if _limited(settings, tenant):
        await redis.zrem(KEY_SESSIONS_KEY.format(tenant=tenant), member)


async def live_sessions(redis: aioredis.Redis, tenant: str) -> int:
    """How many streams ``tenant`` holds now (including leases not yet expired)."""
    return int(await redis.zcard(KEY_SESSIONS_KEY.format(tenant=tenant)))
