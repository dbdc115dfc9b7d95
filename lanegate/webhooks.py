"""Webhook delivery for batch jobs: durable, signed, retried with backoff.

When a job with a ``webhook_url`` completes or fails, the same Lua script that
records the transition also writes a delivery (``WEBHOOK_KEY``: job_id, url,
status, attempts) and schedules it in ``WEBHOOK_DUE_KEY`` (score = due time).
A ``WebhookDispatcher`` (run by every batch worker) leases due deliveries by
moving their score past the lease, POSTs ``{"id": ..., "status": ...}`` (a Deepgram
``callback`` job: Deepgram's whole response, ``lanegate/deepgram_response.py``) and
then deletes the delivery (a 2xx) or reschedules it ``webhook_backoff_s x
2^(attempt-1)`` later (jittered: between half and all of it, ``lanegate.retry``),
up to ``webhook_max_attempts``. A dispatcher that dies
mid-POST leaves the lease to expire and the delivery is sent again: delivery
is at least once; receivers dedupe on ``X-Lanegate-Delivery`` (the job id).
Delivery never touches the job itself.

Signed with a timestamp, as Stripe does, so a captured delivery cannot be
replayed later: ``X-Lanegate-Signature: t=<unix seconds>,v1=<hex
HMAC-SHA256(webhook_secret, "<t>." + body)>``; ``verify_signature`` is what a
receiver runs. Webhooks are *enabled* when ``webhook_secret`` is set: without
it the gateway refuses a ``webhook_url`` (400) and no dispatcher sends anything.

A webhook URL is the client's, so it must not reach inside the network: its
host is resolved once, every address is checked by the policy of
``lanegate/addresses.py`` (loopback and private only with
``webhook_allow_private``; link-local, multicast, reserved, unspecified never),
both at submit (``check_webhook_url``) and at each delivery, and the connection
goes to exactly the addresses that were checked (``CheckedResolver``: no second
lookup, so no DNS rebinding; the Host header and TLS SNI keep the URL's name).
No redirects (a 3xx is a failed attempt); at most ``webhook_max_response_bytes``
of the response are read.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import redis.asyncio as aioredis
from aiohttp.abc import AbstractResolver, ResolveResult
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lanegate.addresses import IPAddress, is_localhost_name, parse_ip, refusals
from lanegate.constants import JOB_KEY, RESULT_KEY, WEBHOOK_DUE_KEY, WEBHOOK_KEY
from lanegate.deepgram_response import DEEPGRAM_FORMAT, callback_body
from lanegate.logs import get_logger
from lanegate.redis_io import decode_hash, text
from lanegate.retry import Backoff, jittered_s
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
#: how far a signature's timestamp may be from the receiver's clock (Stripe's default)
DEFAULT_TOLERANCE_S = 300.0
SCHEMES = ("http", "https")

#: ``lookup(host, port)``: the addresses a name resolves to (the system resolver by
#: default; tests pass their own names)
Lookup = Callable[[str, int], Awaitable[list[IPAddress]]]

log = get_logger("lanegate.webhooks")

# The delivery record (``WEBHOOK_KEY``): job_id, url, status, attempts. A finished
# job's transition script (``lanes.job_protocol``) writes it with this function;
# the dispatcher below reads it and counts its attempts.
SCHEDULE_WEBHOOK_LUA = """
local function schedule_webhook(wh_key, wh_due, job_id, url, status, now, ttl)
  redis.call('HSET', wh_key, 'job_id', job_id, 'url', url, 'status', status,
             'attempts', '0')
  redis.call('PEXPIRE', wh_key, ttl)
  redis.call('ZADD', wh_due, now, job_id)
end
"""

# KEYS = due set; ARGV = now, lease_until, count
_LEASE = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], 'XX', ARGV[2], id) end
return ids
"""


def body_for(job_id: str, status: str) -> bytes:
    return json.dumps({"id": job_id, "status": status}, separators=(",", ":")).encode()


def sign(body: bytes, secret: str, timestamp: int) -> str:
    """The ``X-Lanegate-Signature`` value of ``body`` sent at ``timestamp``."""
    return f"t={timestamp},v1={_digest(secret, timestamp, body)}"


def _digest(secret: str, timestamp: int, body: bytes) -> str:
    signed = f"{timestamp}.".encode() + body
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def verify_signature(secret: str, header: str, body: bytes,
                     tolerance_s: float = DEFAULT_TOLERANCE_S, *,
                     now: float | None = None) -> bool:
    """What a receiver runs: the header is well formed, its timestamp within
    ``tolerance_s`` of ``now`` and one of its ``v1`` values the HMAC of
    ``"<t>." + body`` (constant-time compare)."""
    timestamp: int | None = None
    candidates: list[str] = []
    for item in header.split(","):
        key, _, value = item.strip().partition("=")
        if key == "t" and value.isascii() and value.isdigit():
            timestamp = int(value)
        elif key == "v1":
            candidates.append(value)
    if timestamp is None or not candidates:
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    expected = _digest(secret, timestamp, body)
    return any(hmac.compare_digest(expected.encode(), c.encode()) for c in candidates)


def webhooks_enabled(settings: Settings) -> bool:
    """Webhooks are on when there is a secret to sign them with."""
    return bool(settings.webhook_secret)


# --- where a webhook may go -------------------------------------------------------------


class WebhookRefused(Exception):
    """A webhook URL that may not be called; the message says why."""


async def system_lookup(host: str, port: int) -> list[IPAddress]:
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return _addresses(infos)


def pool_lookup(pool: Executor) -> Lookup:
    """The system resolver run on ``pool`` rather than the loop's default executor
    (the gateway keeps its default threads for other work)."""
    async def lookup(host: str, port: int) -> list[IPAddress]:
        infos = await asyncio.get_running_loop().run_in_executor(
            pool, functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM,
                                    proto=socket.IPPROTO_TCP))
        return _addresses(infos)
    return lookup


def _addresses(infos: list[Any]) -> list[IPAddress]:
    found: list[IPAddress] = []
    for info in infos:
        address = parse_ip(str(info[4][0]))
        if address is not None and address not in found:
            found.append(address)
    return found


async def resolve_checked(host: str, port: int, *, allow_private: bool,
                          lookup: Lookup = system_lookup) -> list[IPAddress]:
    """The addresses ``host`` resolves to, each allowed by the policy; raises
    ``WebhookRefused`` if any is not (a name that resolves to one public and one
    private address is refused), or if the name does not resolve."""
    literal = parse_ip(host)
    if literal is not None:
        addresses = [literal]
    elif is_localhost_name(host) and not allow_private:
        raise WebhookRefused(f"webhook host {host!r} is loopback")
    else:
        try:
            addresses = await lookup(host, port)
        except OSError as exc:
            raise WebhookRefused(f"webhook host {host!r} does not resolve: {exc}") from exc
        if not addresses:
            raise WebhookRefused(f"webhook host {host!r} resolves to no address")
    refused = refusals(addresses, allow_private=allow_private)
    if refused:
        raise WebhookRefused(f"webhook host {host!r} is not allowed: {refused[0]}")
    return addresses


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as exc:
        raise WebhookRefused(f"webhook_url has a bad port: {exc}") from exc
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise WebhookRefused("webhook_url must be an absolute http(s) URL")
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


async def check_webhook_url(url: str, settings: Settings, *,
                            lookup: Lookup = system_lookup) -> None:
    """At submit: raise ``WebhookRefused`` unless ``url``'s host resolves (within
    ``webhook_timeout_s``) only to addresses the policy allows."""
    host, port = _host_port(url)
    try:
        await asyncio.wait_for(
            resolve_checked(host, port, allow_private=settings.webhook_allow_private,
                            lookup=lookup),
            settings.webhook_timeout_s)
    except TimeoutError:
        raise WebhookRefused(f"webhook host {host!r} did not resolve within "
                             f"{settings.webhook_timeout_s:g} s") from None


class CheckedResolver(AbstractResolver):
    """aiohttp's resolver for webhook connections: one lookup, every address
    checked, and only those addresses returned, so the connection goes where the
    check looked."""

    def __init__(self, *, allow_private: bool, lookup: Lookup = system_lookup) -> None:
        self.allow_private = allow_private
        self.lookup = lookup

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        addresses = await resolve_checked(host, port, allow_private=self.allow_private,
                                          lookup=self.lookup)
        return [ResolveResult(
            hostname=host, host=str(a), port=port,
            family=socket.AF_INET6 if a.version == 6 else socket.AF_INET,
            proto=0, flags=socket.AI_NUMERICHOST,
        ) for a in addresses]

    async def close(self) -> None:
        return None


def backoff_s(settings: Settings, attempts: int) -> float:
    """Delay after the ``attempts``-th failed attempt (1, 2, ...): ``webhook_backoff_s``
    doubling, capped, jittered (``lanegate.retry``) so deliveries that failed together
    are not retried together."""
    return jittered_s(settings.webhook_backoff_s, MAX_BACKOFF_S, attempts - 1)


class WebhookDispatcher:
    def __init__(self, redis: aioredis.Redis, settings: Settings, *, worker: str = "",
                 lookup: Lookup = system_lookup) -> None:
        self.redis = redis
        self.settings = settings
        self.worker = worker
        self.lookup = lookup
        self._lease = redis.register_script(_LEASE)
        self._session: aiohttp.ClientSession | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver due webhooks until ``stop`` is set (Redis outages are waited out)."""
        if not webhooks_enabled(self.settings):
            # nothing is sent unsigned: the deliveries wait in Redis for a worker with a
            # secret. Info, not an error: the gateway refuses webhook jobs without one.
            log.info("webhooks_disabled", reason="webhook_secret is empty; deliveries stay "
                      "queued until a worker with LANEGATE_WEBHOOK_SECRET runs")
            await stop.wait()
            return
        backoff = Backoff(POLL_S, REDIS_BACKOFF_MAX_S)
        try:
            while not stop.is_set():
                try:
                    sent = await self.deliver_due()
                    backoff.reset()
                except (RedisConnectionError, RedisTimeoutError) as exc:
                    delay = backoff.next_s()
                    log.warning("webhook_redis_unavailable", error=str(exc), retry_in_s=delay)
                    await _wait(stop, delay)
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
        """One pass: lease the due deliveries and attempt each once; how many
        (none while webhooks are disabled)."""
        if not webhooks_enabled(self.settings):
            return 0
        now = time.time()
        lease_until = now + 2 * self.settings.webhook_timeout_s + 1.0
        ids = [text(i) for i in await self._lease(
            keys=[WEBHOOK_DUE_KEY], args=[repr(now), repr(lease_until), LEASE_BATCH]
        )]
        if ids:
            await asyncio.gather(*(self._deliver(job_id) for job_id in ids))
        return len(ids)

    async def _deliver(self, job_id: str) -> None:
        key = WEBHOOK_KEY.format(job_id=job_id)
        raw = decode_hash(await self.redis.hgetall(key))
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

    async def body(self, job_id: str, status: str) -> bytes:
        """``{"id", "status"}``; for a Deepgram ``callback`` job, Deepgram's response
        (``lanegate/deepgram_response.py``) as Deepgram POSTs it."""
        fmt = await self.redis.hget(JOB_KEY.format(job_id=job_id), "response_format")
        if fmt is not None and text(fmt) == DEEPGRAM_FORMAT:
            result = await self.redis.get(RESULT_KEY.format(job_id=job_id))
            return callback_body(job_id, status, result)
        return body_for(job_id, status)

    async def _post(self, url: str, job_id: str, status: str,
                    attempt: int) -> tuple[int | None, str | None]:
        body = await self.body(job_id, status)
        headers = {"Content-Type": "application/json", DELIVERY_HEADER: job_id,
                   ATTEMPT_HEADER: str(attempt), "User-Agent": "lanegate-webhooks",
                   SIGNATURE_HEADER: sign(body, self.settings.webhook_secret, int(time.time()))}
        try:
            host, port = _host_port(url)
            if parse_ip(host) is not None:  # aiohttp connects to a literal without resolving
                await resolve_checked(host, port, lookup=self.lookup,
                                      allow_private=self.settings.webhook_allow_private)
            async with self._client().post(url, data=body, headers=headers,
                                           allow_redirects=False) as resp:
                await resp.content.read(self.settings.webhook_max_response_bytes)
                return resp.status, None
        except WebhookRefused as exc:
            log.warning("webhook_refused", job_id=job_id, attempt=attempt, error=str(exc))
            return None, f"refused: {exc}"
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return None, f"{type(exc).__name__}: {exc}"

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            resolver = CheckedResolver(allow_private=self.settings.webhook_allow_private,
                                       lookup=self.lookup)
            # no DNS cache and no kept-alive connections: every delivery is resolved,
            # checked and connected afresh
            connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False,
                                             force_close=True)
            timeout = aiohttp.ClientTimeout(total=self.settings.webhook_timeout_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                                  trust_env=False, auto_decompress=False)
        return self._session


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
