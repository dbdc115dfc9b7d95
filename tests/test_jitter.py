"""What failed together does not retry together (issue 34): webhook deliveries, a batch
worker's Redis reconnects and the supervisor's restarts wait exponentially longer with
redis-py's equal jitter, each delay between half and all of the doubled one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from structlog.testing import capture_logs
from test_webhooks import Env, env_factory  # noqa: F401 (the fixture)

from engines import create_engine
from lanegate.constants import WEBHOOK_DUE_KEY
from lanegate.redis_io import redis_client
from lanegate.settings import EngineName, Settings
from lanegate.supervisor import BACKOFF_FIRST_S, BACKOFF_MAX_S, Child, Supervisor, free_port
from lanegate.webhooks import MAX_BACKOFF_S, backoff_s
from workers.batch import BACKOFF_MAX_S as REDIS_MAX_S
from workers.batch import BACKOFF_MIN_S as REDIS_MIN_S
from workers.batch import BatchConsumer


def within_equal_jitter(delay: float, nominal: float) -> bool:
    return nominal / 2 - 1e-9 <= delay <= nominal + 1e-9


def test_webhook_backoff_doubles_from_the_setting_with_jitter() -> None:
    settings = Settings(webhook_backoff_s=0.5)
    for attempt in (1, 2, 3, 4, 100):
        nominal = min(MAX_BACKOFF_S, 0.5 * 2 ** (attempt - 1))
        delays = {backoff_s(settings, attempt) for _ in range(50)}
        assert all(within_equal_jitter(d, nominal) for d in delays), (attempt, delays)
        assert len(delays) > 1, f"attempt {attempt}: every delivery waits {delays}"


async def test_deliveries_that_failed_together_are_not_retried_together(
        env_factory: Callable[..., Env]) -> None:  # noqa: F811
    """Twelve deliveries refused at once (a loopback receiver, not allowed here) are
    rescheduled over a spread of times, not to one instant."""
    from lanegate.webhooks import WebhookDispatcher

    env = env_factory(webhook_allow_private=False, webhook_backoff_s=3600.0)
    for n in range(12):
        await env.due(f"j{n}", "http://127.0.0.1:9/hook")
    dispatcher = WebhookDispatcher(env.redis, env.settings)
    failed_at = time.time()
    try:
        assert await dispatcher.deliver_due() == 12
    finally:
        await dispatcher.close()
    due = [float(await env.redis.zscore(WEBHOOK_DUE_KEY, f"j{n}") or 0) - failed_at
           for n in range(12)]
    assert len(due) == 12
    assert all(1800 - 1 <= d <= 3600 + 60 for d in due), due
    assert max(due) - min(due) > 60, f"all retried together: {sorted(due)}"


def _retry_delays(events: list[MutableMapping[str, Any]], worker: str) -> list[float]:
    return [float(e["retry_in_s"]) for e in events
            if e.get("event") == "redis_unavailable" and e.get("worker") == worker]


async def test_batch_workers_that_lost_redis_together_reconnect_apart() -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    settings = Settings(engine=EngineName.SIMULATED, redis_url=dead)
    consumers, clients = [], []
    for name in ("w1", "w2"):
        client = redis_client(dead)
        clients.append(client)
        consumers.append(BatchConsumer(settings, client, create_engine(settings, slots=0),
                                       worker_id=name, webhooks=False))
    stop = asyncio.Event()
    with capture_logs() as events:
        tasks = [asyncio.create_task(c.run(stop)) for c in consumers]
        deadline = time.monotonic() + 60
        while min(len(_retry_delays(events, w)) for w in ("w1", "w2")) < 4:
            assert time.monotonic() < deadline, events[-5:]
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.gather(*tasks)
    for client in clients:
        await client.aclose()
    first, second = (_retry_delays(events, w)[:4] for w in ("w1", "w2"))
    for delays in (first, second):
        for n, delay in enumerate(delays):
            assert within_equal_jitter(delay, min(REDIS_MAX_S, REDIS_MIN_S * 2 ** n)), delays
    assert first != second, f"both workers retried at {first}"


def test_children_that_crashed_together_are_restarted_apart() -> None:
    now = time.monotonic()
    children = [Child(f"c{n}", ["true"], {}) for n in range(12)]
    for child in children:
        Supervisor._schedule_restart(child, now)
    delays = [child.restart_at - now for child in children if child.restart_at is not None]
    assert all(within_equal_jitter(d, BACKOFF_FIRST_S) for d in delays), delays
    assert len(set(delays)) > 1, f"all restarted together after {delays[0]} s"
    assert {c.backoff_s for c in children} == {min(BACKOFF_MAX_S, 2 * BACKOFF_FIRST_S)}

