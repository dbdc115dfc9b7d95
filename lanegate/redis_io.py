"""The one way this project makes a Redis client and reads its replies."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff

from lanegate.redis_url import DirectTarget, parse_redis_url

CONNECT_TIMEOUT_S = 2.0
#: per-command socket timeout of the workers' clients (the gateway's has none: its
#: blocking reads are legitimate)
SOCKET_TIMEOUT_S = 10.0
HEALTH_CHECK_S = 5
#: a sentinel answers from memory: a slow one is skipped for the next
SENTINEL_TIMEOUT_S = 1.0


def redis_client(url: str, *, socket_timeout: float | None = SOCKET_TIMEOUT_S) -> aioredis.Redis:
    """A client for ``url`` (``redis://``, ``rediss://``, ``unix://`` or
    ``redis+sentinel://``, parsed by ``lanegate.redis_url``) that retries a command a
    few times on a dropped connection.

    ``Redis.from_url`` in redis-py 8 gives its connections no retries, so the first
    command on a pooled connection after a Redis restart (or a failover) fails; with
    these retries it reconnects instead. Longer outages still raise
    ``ConnectionError`` (a ``MasterNotFoundError`` while no primary is known), which
    the workers wait out with backoff. Behind Sentinel the client follows the
    primary: redis-py's ``SentinelConnectionPool`` asks a sentinel again for every new
    connection, and a connection to a demoted primary is dropped at its first
    ``READONLY`` answer. ``socket_timeout=None`` is for a process whose blocking reads
    may last longer.
    """
    target = parse_redis_url(url)
    options: dict[str, Any] = {
        "socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_timeout": socket_timeout,
        "health_check_interval": HEALTH_CHECK_S,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
    }
    if isinstance(target, DirectTarget):
        return aioredis.Redis.from_url(target.url, **options)
    # Sentinel.__init__ is untyped in some redis-py releases (>=5.0 allowed) and typed
    # in others, so the ignore is needed in one and unused in the other.
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        list(target.sentinels),
        sentinel_kwargs={"socket_connect_timeout": SENTINEL_TIMEOUT_S,
                         "socket_timeout": SENTINEL_TIMEOUT_S,
                         "username": target.sentinel_username,
                         "password": target.sentinel_password},
    )
    client: aioredis.Redis = sentinel.master_for(
        target.service_name, redis_class=aioredis.Redis, db=target.db,
        username=target.username, password=target.password, **options)
    return client


def text(value: object) -> str:
    """A reply value as ``str`` (replies are bytes unless the client decodes them)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_hash(raw: dict[Any, Any]) -> dict[str, str]:
    return {text(k): text(v) for k, v in raw.items()}


def ttl_ms(seconds: float) -> int:
    """A TTL for ``PX``/``PEXPIRE``: whole milliseconds, at least one."""
    return max(1, int(seconds * 1000))
