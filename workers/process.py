"""The worker-process shell the realtime and batch workers share: the worker id,
the internal HTTP server (``/healthz``, ``/readyz``, ``/metrics`` and whatever a
worker adds), the heartbeat into the registry, SIGTERM/SIGINT and leaving the
registry on the way out."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import redis.asyncio as aioredis
from aiohttp import web

from lanegate import metrics
from lanegate.constants import WorkerLane
from lanegate.logs import configure_logging, get_logger
from lanegate.loops import run
from lanegate.settings import Settings
from lanes import registry

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# After a drain deadline, how long open handlers may take to finish.
FLUSH_TIMEOUT_S = 5.0
# How long leaving the registry may take on the way out (Redis may be down).
REGISTRY_TIMEOUT_S = 2.0


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


async def within(waitable: Any, timeout_s: float) -> bool:
    """Await ``waitable`` for at most ``timeout_s``; False if it timed out."""
    try:
        await asyncio.wait_for(waitable, timeout_s)
    except TimeoutError:
        return False
    return True


async def wait(stop: asyncio.Event | None, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``stop`` is set meanwhile."""
    if stop is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


def on_stop_signals(callback: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, callback)


def main(settings: Settings, lane: WorkerLane,
         serve: Callable[[Settings], Coroutine[Any, Any, int]]) -> int:
    """A worker process's entry: logging, the Redis check, then ``serve`` to the end."""
    worker_id = settings.worker_id or default_worker_id()
    configure_logging(settings.log_level, settings.log_format, lane=lane, worker=worker_id)
    if not settings.redis_url:
        get_logger("lanegate.worker").error("worker_needs_redis",
                                            message="set LANEGATE_REDIS_URL or --redis-url")
        return 2
    return run(serve(settings.replace(worker_id=worker_id)), settings.event_loop)


class WorkerShell:
    """One worker's internal server and registry record.

    ``info`` is called for every heartbeat; ``url`` is known once ``start`` has
    bound the port."""

    def __init__(self, settings: Settings, redis: aioredis.Redis, lane: WorkerLane,
                 worker_id: str,
                 info: Callable[[], registry.WorkerInfo]) -> None:
        self.settings = settings
        self.redis = redis
        self.lane = lane
        self.worker_id = worker_id
        self.port = 0
        self._info = info
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._left = False  # out of the registry for good: no more heartbeats
        self._log = get_logger("lanegate.worker", lane=lane, worker=worker_id)

    @property
    def url(self) -> str:
        host = self.settings.worker_advertise_host or self.settings.worker_host
        return f"http://{host}:{self.port}"

    def app(self, healthz: Handler, readyz: Handler) -> web.Application:
        """The internal app with the probes and ``/metrics``; a worker adds its routes."""
        app = web.Application()
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/metrics", metrics.metrics_view)
        return app

    async def start(self, app: web.Application) -> None:
        """Serve ``app``, publish the first record and keep heartbeating."""
        metrics.init_worker_series(self.lane, self.worker_id)
        # A bounded shutdown: aiohttp's default waits 60 s for open handlers.
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None,
                                     shutdown_timeout=FLUSH_TIMEOUT_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.worker_host, self.settings.worker_port)
        await site.start()
        self.port = _bound_port(self._runner)
        await self.publish()
        self.spawn(self._heartbeat())

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """A background task that ``close`` cancels."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def publish(self) -> None:
        if self._left:
            return
        try:
            await registry.publish(self.redis, self._info(), self.settings.heartbeat_ttl_s)
        except Exception as exc:  # Redis down: keep serving, retry next beat
            self._log.warning("heartbeat_failed", error=str(exc))

    def publish_soon(self) -> None:
        """Republish now (the heartbeat alone lags a beat)."""
        if self._runner is not None:
            self.spawn(self.publish())

    async def close(self) -> None:
        """Stop the background tasks, leave the registry, stop the server."""
        runner, self._runner = self._runner, None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.leave_registry()
        if runner is not None:
            await runner.cleanup()

    async def leave_registry(self) -> None:
        """Remove this worker's record and publish no more (a worker that must not be
        picked again: stopping, or stalled)."""
        self._left = True
        with contextlib.suppress(Exception):
            await within(registry.remove(self.redis, self.worker_id, self.lane),
                         REGISTRY_TIMEOUT_S)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            await self.publish()


def _bound_port(runner: web.AppRunner) -> int:
    for address in runner.addresses:
        return int(address[1])
    raise RuntimeError("the worker's server is not bound")
