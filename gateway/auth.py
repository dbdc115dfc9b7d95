"""API keys, tenants and the per-key concurrent stream limit.

A caller presents ``Authorization: Bearer <key>`` or ``?api_key=<key>``; the key
must be in ``settings.api_key_set``. With no keys configured auth is off and
every caller is the tenant ``"anonymous"``.

A tenant id is derived from the key (``key-`` + 16 hex digits of its SHA-256),
so keys themselves never appear in Redis key names, logs or metrics.

The per-key session limit (``max_sessions_per_key``) is counted in Redis, so it
holds across gateway replicas: ``KEY_SESSIONS_KEY`` is a sorted set of the
tenant's live session ids scored by a lease expiry (Redis server time). A
live stream refreshes its lease every ``session_lease_s / 3``; the entries of a
gateway that died expire after ``session_lease_s``. The limit applies only when
auth is on (anonymous callers are not one tenant to throttle).
"""

from __future__ import annotations

import hashlib
import hmac

import redis.asyncio as aioredis
from aiohttp import web

from gateway.errors import json_error
from gateway.state import SETTINGS
from lanegate.constants import KEY_SESSIONS_KEY
from lanegate.settings import Settings

ANONYMOUS = "anonymous"

# KEYS[1] = the tenant's set; ARGV = member, limit, lease_ms.
# Scores are expiry times in ms of Redis server time, so gateways' clocks do not matter.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) == false
   and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""


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


def authenticate(request: web.Request) -> str | None:
    """The caller's tenant, or None when auth is on and the key is missing or wrong."""
    keys = request.app[SETTINGS].api_key_set
    if not keys:
        return ANONYMOUS
    presented = api_key_of(request)
    if presented is None:
        return None
    # constant-time comparison against every configured key
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented.encode(), key.encode())
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


def _limited(settings: Settings, tenant: str) -> bool:
    return tenant != ANONYMOUS and settings.max_sessions_per_key > 0


async def acquire_session(
    redis: aioredis.Redis, settings: Settings, tenant: str, session_id: str
) -> bool:
    """Count a new stream for ``tenant``; False when it already has the maximum.

    Calling it again for a live ``session_id`` refreshes its lease.
    """
    if not _limited(settings, tenant):
        return True
    result = await redis.eval(
        _ACQUIRE, 1, KEY_SESSIONS_KEY.format(tenant=tenant),
        session_id, settings.max_sessions_per_key, int(settings.session_lease_s * 1000),
    )
    return bool(int(result))


async def refresh_session(
    redis: aioredis.Redis, settings: Settings, tenant: str, session_id: str
) -> None:
    """Extend a live stream's lease (call every ``session_lease_s / 3``)."""
    if _limited(settings, tenant):
        await acquire_session(redis, settings, tenant, session_id)


async def release_session(
    redis: aioredis.Redis, settings: Settings, tenant: str, session_id: str
) -> None:
    """Stop counting a stream that ended."""
    if _limited(settings, tenant):
        await redis.zrem(KEY_SESSIONS_KEY.format(tenant=tenant), session_id)


async def live_sessions(redis: aioredis.Redis, tenant: str) -> int:
    """How many streams ``tenant`` holds now (including leases not yet expired)."""
    return int(await redis.zcard(KEY_SESSIONS_KEY.format(tenant=tenant)))
