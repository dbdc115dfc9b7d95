"""Webhook delivery for batch jobs: durable, signed, retried with backoff.

When a job with a ``webhook_url`` completes or fails, the same Lua script that
records the transition also writes a delivery (``WEBHOOK_KEY``: job_id, url,
status, attempts) and schedules it in ``WEBHOOK_DUE_KEY`` (score = due time).
A ``WebhookDispatcher`` (run by every batch worker) leases due deliveries by
moving their score past the lease, POSTs ``{"id": ..., "status": ...}`` and
then deletes the delivery (a 2xx) or reschedules it ``webhook_backoff_s x
2^(attempt-1)`` later, up to ``webhook_max_attempts``. A dispatcher that dies
mid-POST leaves the lease to expire and the delivery is sent again: delivery
is at least once; receivers dedupe on ``X-Lanegate-Delivery`` (the job id).
Delivery never touches the job itself.

The body is signed: ``X-Lanegate-Signature: sha256=<hex HMAC-SHA256(body,
webhook_secret)>`` over the exact bytes sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import time

import aiohttp
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lanegate.constants import WEBHOOK_DUE_KEY, WEBHOOK_KEY
from lanegate.logs import get_logger
from lanegate.settings import Settings

SIGNATURE_HEADER = "X-Lanegate-Signature"
DELIVERY_HEADER = "X-Lanegate-Delivery"
ATTEMPT_HEADER = "X-Lanegate-Attempt"
#: how often an idle dispatcher looks for due deliveries
POLL_S = 0.2
#: longest wait between two looks at an unreachable Redis
REDIS_BACKOFF_MAX_S = 5.0
#: most deliveries leased (and sent concurrently) per pass
LEASE_BATCH = 16
#: longest wait between two attempts, however many attempts
MAX_BACKOFF_S = 3600.0

log = get_logger("lanegate.webhooks")

# KEYS = due set; ARGV = now, lease_until, count
_LEASE = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], 'XX', ARGV[2], id) end
return ids
"""


def body_for(job_id: str, status: str) -> bytes:
    return json.dumps({"id": job_id, "status": status}, separators=(",", ":")).encode()


def sign(body: bytes, secret: str) -> str:
    """The ``X-Lanegate-Signature`` value of ``body``."""
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def verify(body: bytes, secret: str, header: str) -> bool:
    """What a receiver does: constant-time compare of the signature header."""
    return hmac.compare_digest(sign(body, secret), header)


def backoff_s(settings: Settings, attempts: int) -> float:
    """Delay after the ``attempts``-th failed attempt (1, 2, ...)."""
    return float(min(MAX_BACKOFF_S, settings.webhook_backoff_s * 2 ** max(0, attempts - 1)))


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class WebhookDispatcher:
    def __init__(self, redis: aioredis.Redis, settings: Settings, *, worker: str = "") -> None:
        self.redis = redis
        self.settings = settings
        self.worker = worker
        self._lease = redis.register_script(_LEASE)
        self._session: aiohttp.ClientSession | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver due webhooks until ``stop`` is set (Redis outages are waited out)."""
        if not self.settings.webhook_secret:
            log.warning("webhook_unsigned", reason="webhook_secret is empty")
        backoff = POLL_S
        try:
            while not stop.is_set():
                try:
                    sent = await self.deliver_due()
                    backoff = POLL_S
                except (RedisConnectionError, RedisTimeoutError) as exc:
                    log.warning("webhook_redis_unavailable", error=str(exc), retry_in_s=backoff)
                    await _wait(stop, backoff)
                    backoff = min(REDIS_BACKOFF_MAX_S, backoff * 2)
                    continue
                if not sent:
                    await _wait(stop, POLL_S)
        finally:
            await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def deliver_due(self) -> int:
        """One pass: lease the due deliveries and attempt each once; how many."""
        now = time.time()
        lease_until = now + 2 * self.settings.webhook_timeout_s + 1.0
        ids = [_s(i) for i in await self._lease(
            keys=[WEBHOOK_DUE_KEY], args=[repr(now), repr(lease_until), LEASE_BATCH]
        )]
        if ids:
            await asyncio.gather(*(self._deliver(job_id) for job_id in ids))
        return len(ids)

    async def _deliver(self, job_id: str) -> None:
        key = WEBHOOK_KEY.format(job_id=job_id)
        raw = {_s(k): _s(v) for k, v in (await self.redis.hgetall(key)).items()}
        if not raw:
            await self.redis.zrem(WEBHOOK_DUE_KEY, job_id)
            return
        attempts = int(raw.get("attempts") or 0) + 1
        status, error = await self._post(raw["url"], job_id, raw["status"], attempts)
        if status is not None and 200 <= status < 300:
            await self._done(key, job_id)
            log.info("webhook_delivered", job_id=job_id, attempt=attempts, http_status=status)
        elif attempts >= self.settings.webhook_max_attempts:
            await self._done(key, job_id)
            log.warning("webhook_gave_up", job_id=job_id, attempts=attempts,
                        http_status=status, error=error)
        else:
            delay = backoff_s(self.settings, attempts)
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, "attempts", str(attempts))
                pipe.zadd(WEBHOOK_DUE_KEY, {job_id: time.time() + delay}, xx=True)
                await pipe.execute()
            log.info("webhook_retry", job_id=job_id, attempt=attempts, http_status=status,
                     error=error, retry_in_s=delay)

    async def _done(self, key: str, job_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.zrem(WEBHOOK_DUE_KEY, job_id)
            await pipe.execute()

    async def _post(self, url: str, job_id: str, status: str,
                    attempt: int) -> tuple[int | None, str | None]:
        body = body_for(job_id, status)
        headers = {"Content-Type": "application/json", DELIVERY_HEADER: job_id,
                   ATTEMPT_HEADER: str(attempt), "User-Agent": "lanegate-webhooks"}
        if self.settings.webhook_secret:
            headers[SIGNATURE_HEADER] = sign(body, self.settings.webhook_secret)
        try:
            async with self._client().post(url, data=body, headers=headers,
                                           allow_redirects=False) as resp:
                await resp.read()
                return resp.status, None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return None, f"{type(exc).__name__}: {exc}"

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=self.settings.webhook_timeout_s)
            self._session = aiohttp.ClientSession(timeout=timeout)
        return self._session


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
