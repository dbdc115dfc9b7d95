"""The realtime (and mixed) worker: an internal WebSocket server around the step loop.

Serves ``/internal/v1/link`` (a gateway's sessions multiplexed on one WebSocket,
``workers/link.py``) and ``/internal/v1/session`` (one session per WebSocket), both
in docs/INTERNALS.md, plus ``/healthz``, ``/readyz`` and ``/metrics`` on one port;
heartbeats into the Redis registry; on SIGTERM stops taking sessions, lets the
active ones finish up to ``drain_timeout_s``, flushes the rest and exits 0. In
``mixed`` mode it also consumes the batch job stream and decodes whole batches in
its own step loop, uncapped: the naive design that the split lanes replace.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import prometheus_client
import redis.asyncio as aioredis
from aiohttp import WSMsgType, web

from lanegate import metrics
from lanegate.constants import CLOSE_POLICY
from lanegate.logs import configure_logging, get_logger
from lanegate.settings import Settings
from lanes.queue import redis_client
from lanes.session import Event, RealtimeSession
from lanes.steploop import Close, SessionHandle, StepLoop, percentile
from vad import VadSettings
from workers import registry
from workers.engines import Engine, NoFreeSlot, create_engine
from workers.link import LINK_PATH, serve_link
from workers.validation import (
    Overloaded,
    Refused,
    audio_problem,
    control_problem,
    end_problem,
    session_params,
)

SESSION_PATH = "/internal/v1/session"
# Event-loop lag probe period.
LAG_PROBE_S = 0.05
# After the drain deadline, how long flushing the last finals may take.
FLUSH_TIMEOUT_S = 5.0
# How long leaving the registry may take on the way out (Redis may be down).
REGISTRY_TIMEOUT_S = 2.0


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class RealtimeWorker:
    def __init__(self, settings: Settings, engine: Engine, redis: aioredis.Redis, *,
                 lane: str = "realtime") -> None:
        if lane not in ("realtime", "mixed"):
            raise ValueError(f"a realtime worker serves lane realtime or mixed, not {lane!r}")
        self.settings = settings
        self.engine = engine
        self.redis = redis
        self.lane = lane
        self.worker_id = settings.worker_id or default_worker_id()
        self.loop = StepLoop(engine, settings, lane=lane, worker_id=self.worker_id)
        self.draining = False
        self.port = 0
        self.lag_s: list[float] = []
        self._stop = asyncio.Event()
        self._batch_stop = asyncio.Event()
        self._stopped = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._batch_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner: web.AppRunner | None = None
        self._vad = VadSettings.from_settings(settings)
        self._log = get_logger("lanegate.worker", lane=lane, worker=self.worker_id)
        self._labels = {"lane": lane, "worker": self.worker_id}

    @property
    def url(self) -> str:
        host = self.settings.worker_advertise_host or self.settings.worker_host
        return f"http://{host}:{self.port}"

    # --- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(SESSION_PATH, self._session)
        app.router.add_get(LINK_PATH, self._link)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        metrics.init_worker_series(self.lane, self.worker_id)
        # A bounded shutdown: aiohttp's default waits 60 s for open handlers.
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None,
                                     shutdown_timeout=FLUSH_TIMEOUT_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.worker_host, self.settings.worker_port)
        await site.start()
        self.port = _bound_port(self._runner)
        self._loop_task = asyncio.create_task(self.loop.run(self._stop))
        self._spawn(self._heartbeat())
        self._spawn(self._probe_lag())
        if self.lane == "mixed":
            self._batch_task = asyncio.create_task(self._batch_consumer())
        await self._publish()
        self._log.info("worker_started", url=self.url, engine=self.engine.name,
                       slots=self.engine.slots_total, capped=self.loop.limits.capped)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Stop taking sessions, let the active ones finish, flush the rest, stop."""
        if self.draining:
            return
        self.draining = True
        self._log.info("drain_started", sessions=len(self.loop.sessions))
        await self._publish()
        if not await _within(self.loop.idle.wait(), self.settings.drain_timeout_s):
            self._log.info("drain_timeout", sessions=len(self.loop.sessions))
            self.loop.flush_all()
            await _within(self.loop.idle.wait(), FLUSH_TIMEOUT_S)
        await self.stop()

    async def stop(self) -> None:
        if self._stopped.is_set():
            return
        if self._batch_task is not None:
            # The consumer hands its unfinished jobs back; its last batch needs the loop.
            self._batch_stop.set()
            if not await _within(asyncio.shield(self._batch_task), FLUSH_TIMEOUT_S):
                self._batch_task.cancel()
        self._stop.set()  # the step loop ends itself between steps
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *[t for t in (self._loop_task, self._batch_task) if t],
                             return_exceptions=True)
        with contextlib.suppress(Exception):
            await _within(registry.remove(self.redis, self.worker_id, self.lane),
                          REGISTRY_TIMEOUT_S)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._log.info("worker_stopped", **self.loop.stats(),
                       loop_lag_p99_ms=round(percentile(self.lag_s, 0.99) * 1000, 2),
                       loop_lag_max_ms=round(max(self.lag_s, default=0.0) * 1000, 2))
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # --- registry and probes ---------------------------------------------------------
    def info(self) -> registry.WorkerInfo:
        return registry.WorkerInfo(
            worker_id=self.worker_id, lane=self.lane, url=self.url, engine=self.engine.name,
            slots_total=self.engine.slots_total, slots_free=self.engine.slots_free(),
            step_p99_ms=round(self.loop.step_p99_ms(), 2), draining=self.draining)

    async def _publish(self) -> None:
        try:
            await registry.publish(self.redis, self.info(), self.settings.heartbeat_ttl_s)
        except Exception as exc:  # Redis down: keep serving, retry next beat
            self._log.warning("heartbeat_failed", error=str(exc))

    def publish_soon(self) -> None:
        """Republish now: a slot was taken or freed (the heartbeat alone lags a beat)."""
        if not self._stop.is_set():
            self._spawn(self._publish())

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            await self._publish()

    async def _probe_lag(self) -> None:
        """How late the loop wakes a timer: the time network I/O would wait."""
        histogram = metrics.EVENT_LOOP_LAG.labels(**self._labels)
        while True:
            before = time.perf_counter()
            await asyncio.sleep(LAG_PROBE_S)
            lag = max(0.0, time.perf_counter() - before - LAG_PROBE_S)
            histogram.observe(lag)
            self.lag_s.append(lag)
            if len(self.lag_s) > 4096:
                del self.lag_s[:2048]

    async def _batch_consumer(self) -> None:
        # Imported late: only mixed workers need the batch lane.
        batch = importlib.import_module("workers.batch")
        consumer = batch.BatchConsumer(self.settings, self.redis, self.engine, lane="mixed",
                                       decode=self.loop.submit_batch, worker_id=self.worker_id)
        await consumer.run(self._batch_stop)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "worker": self.worker_id, "lane": self.lane})

    async def _readyz(self, request: web.Request) -> web.Response:
        try:
            await self.redis.ping()
        except Exception as exc:
            return web.json_response({"status": "redis unreachable", "error": str(exc)},
                                     status=503)
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ready", "slots_free": self.engine.slots_free()})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=prometheus_client.generate_latest(),
                            headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})

    # --- sessions (both endpoints) ------------------------------------------------------
    def open_session(self, session_id: str, rate: int,
                     sink: Callable[[Event | Close], None] | None = None) -> SessionHandle:
        """A new session in the step loop; ``Overloaded`` while draining or full."""
        if self.draining:
            raise Overloaded("worker is draining")
        try:
            stream = self.engine.open_stream()
        except NoFreeSlot as exc:
            raise Overloaded(str(exc)) from None
        session = RealtimeSession(session_id, rate, stream, self._vad,
                                  int(self.settings.max_window_s * self.engine.sample_rate),
                                  vad_inline_samples=self.loop.vad_slice_samples)
        handle = self.loop.add(session, sink=sink)
        self.publish_soon()
        self._log.info("session_start", session_id=session_id, sample_rate=rate)
        return handle

    def accepted(self) -> Event:
        return {"type": "accepted", "worker": self.worker_id, "lane": self.lane}

    def log_refusal(self, exc: Refused, session_id: str | None) -> None:
        self._log.info("session_refused", session_id=session_id, code=exc.code,
                       message=str(exc))

    def reject(self, handle: SessionHandle, message: str) -> None:
        """The gateway broke the protocol on this session: ``bad_request``, then close."""
        handle.send([{"type": "error", "code": "bad_request", "message": message}])
        handle.post(Close(CLOSE_POLICY))
        handle.abandoned = True
        handle.session.ended = True
        self.loop.touch(handle)

    def feed(self, handle: SessionHandle, pcm: bytes) -> bool:
        """One frame of the gateway's audio for the session; False if it was bad (the
        session is then rejected)."""
        problem = audio_problem(pcm, handle.session.ended)
        if problem:
            self.reject(handle, problem)
            return False
        handle.session.receive(pcm, time.monotonic())
        self.loop.touch(handle)
        return True

    def end_audio(self, handle: SessionHandle) -> bool:
        """The gateway's ``end`` for the session; False if it came twice (rejected)."""
        problem = end_problem(handle.session.ended)
        if problem:
            self.reject(handle, problem)
            return False
        handle.session.end(time.monotonic())
        self.loop.touch(handle)
        return True

    def abandon(self, handle: SessionHandle) -> None:
        """The gateway's side of the session is gone: drop it and free its slot."""
        handle.abandoned = True
        handle.post(Close(CLOSE_POLICY))
        self.loop.touch(handle)

    # --- one session per WebSocket -------------------------------------------------------
    async def _session(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=self.settings.max_frame_bytes + 1024)
        await ws.prepare(request)
        session_id = request.query.get("session_id")
        try:
            session_id, rate = session_params(session_id, request.query.get("sample_rate"))
            handle = self.open_session(session_id, rate)
        except Refused as exc:
            return await self._refuse(ws, exc, session_id)
        await ws.send_json(self.accepted())
        sender = asyncio.create_task(_send_outbox(ws, handle))
        try:
            await self._receive(ws, handle)
        finally:
            if not handle.session.ended:
                self.abandon(handle)
            with contextlib.suppress(asyncio.CancelledError):
                await sender
            self.publish_soon()
        return ws

    async def _link(self, request: web.Request) -> web.WebSocketResponse:
        return await serve_link(self, request)

    async def _receive(self, ws: web.WebSocketResponse, handle: SessionHandle) -> None:
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                if not self.feed(handle, msg.data):
                    return None
            elif msg.type == WSMsgType.TEXT:
                problem = control_problem(msg.data)
                if problem:
                    return self.reject(handle, problem)
                if not self.end_audio(handle):
                    return None
            else:
                return None
        return None

    async def _refuse(self, ws: web.WebSocketResponse, exc: Refused,
                      session_id: str | None) -> web.WebSocketResponse:
        self.log_refusal(exc, session_id)
        await ws.send_json({"type": "error", "code": exc.code, "message": str(exc)})
        await ws.close(code=exc.close_code)
        return ws


async def _send_outbox(ws: web.WebSocketResponse, handle: SessionHandle) -> None:
    while True:
        item = await handle.outbox.get()
        if isinstance(item, Close):
            if not ws.closed:
                await ws.close(code=item.code)
            return
        if ws.closed:
            continue
        try:
            await ws.send_json(item)
        except (ConnectionError, RuntimeError):
            handle.abandoned = True


async def _within(waitable: Any, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(waitable, timeout_s)
    except TimeoutError:
        return False
    return True


def _bound_port(runner: web.AppRunner) -> int:
    for address in runner.addresses:
        return int(address[1])
    raise RuntimeError("the worker's server is not bound")


# --- process entry ------------------------------------------------------------------
async def serve(settings: Settings, lane: str) -> int:
    log = get_logger("lanegate.worker", lane=lane)
    engine = await asyncio.get_running_loop().run_in_executor(
        None, lambda: create_engine(settings, slots=settings.slots, batch=lane == "mixed"))
    redis = redis_client(settings.redis_url)
    worker = RealtimeWorker(settings, engine, redis, lane=lane)
    await worker.start()
    drains: set[asyncio.Task[None]] = set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(
            sig, lambda: drains.add(asyncio.create_task(worker.drain())))
    await worker.wait_stopped()
    await redis.aclose()
    log.info("worker_exit")
    return 0


def main(settings: Settings, lane: str = "realtime") -> int:
    configure_logging(settings.log_level, lane=lane,
                      worker=settings.worker_id or default_worker_id())
    if not settings.redis_url:
        get_logger("lanegate.worker").error("worker_needs_redis",
                                            message="set LANEGATE_REDIS_URL or --redis-url")
        return 2
    return asyncio.run(serve(settings, lane))
