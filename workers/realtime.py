"""The realtime (and mixed) worker: an internal WebSocket server around the step loop.

Serves ``/internal/v1/session`` (the gateway's relay, see docs/INTERNALS.md),
``/healthz``, ``/readyz`` and ``/metrics`` on one port; heartbeats into the
Redis registry; on SIGTERM stops taking sessions, lets the active ones finish
up to ``drain_timeout_s``, flushes the rest and exits 0. In ``mixed`` mode it
also consumes the batch job stream and decodes whole batches in its own step
loop, uncapped: the naive design that the split lanes replace.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import signal
import socket
import time
import uuid
from typing import Any

import prometheus_client
import redis.asyncio as aioredis
from aiohttp import WSMsgType, web

from lanegate import metrics
from lanegate.constants import CLOSE_OVERLOADED, CLOSE_POLICY
from lanegate.logs import configure_logging, get_logger
from lanegate.settings import Settings
from lanes.queue import redis_client
from lanes.session import RealtimeSession
from lanes.steploop import Close, SessionHandle, StepLoop, percentile
from vad import VadSettings
from workers import registry
from workers.engines import Engine, NoFreeSlot, create_engine

SESSION_PATH = "/internal/v1/session"
MIN_RATE, MAX_RATE = 8000, 48000
# Event-loop lag probe period.
LAG_PROBE_S = 0.05
# After the drain deadline, how long flushing the last finals may take.
FLUSH_TIMEOUT_S = 5.0
# How long leaving the registry may take on the way out (Redis may be down).
REGISTRY_TIMEOUT_S = 2.0


class BadRequest(ValueError):
    pass


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

    def _publish_soon(self) -> None:
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

    # --- one session -------------------------------------------------------------------
    async def _session(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=self.settings.max_frame_bytes + 1024)
        await ws.prepare(request)
        try:
            session_id, rate = _session_params(request)
        except BadRequest as exc:
            return await self._refuse(ws, "bad_request", str(exc), CLOSE_POLICY)
        if self.draining:
            return await self._refuse(ws, "overloaded", "worker is draining", CLOSE_OVERLOADED,
                                      session_id)
        try:
            stream = self.engine.open_stream()
        except NoFreeSlot as exc:
            return await self._refuse(ws, "overloaded", str(exc), CLOSE_OVERLOADED, session_id)
        session = RealtimeSession(session_id, rate, stream, self._vad,
                                  int(self.settings.max_window_s * self.engine.sample_rate),
                                  vad_inline_samples=self.loop.vad_slice_samples)
        handle = self.loop.add(session)
        self._publish_soon()
        self._log.info("session_start", session_id=session_id, sample_rate=rate)
        await ws.send_json({"type": "accepted", "worker": self.worker_id, "lane": self.lane})
        sender = asyncio.create_task(_send_outbox(ws, handle))
        try:
            await self._receive(ws, handle)
        finally:
            if not session.ended:
                handle.abandoned = True
                handle.post(Close(CLOSE_POLICY))
                self.loop.touch(handle)
            with contextlib.suppress(asyncio.CancelledError):
                await sender
            self._publish_soon()
        return ws

    async def _receive(self, ws: web.WebSocketResponse, handle: SessionHandle) -> None:
        session = handle.session
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                problem = _audio_problem(msg.data, session.ended)
                if problem:
                    return self._reject(handle, problem)
                session.receive(msg.data, time.monotonic())
            elif msg.type == WSMsgType.TEXT:
                problem = _control_problem(msg.data, session.ended)
                if problem:
                    return self._reject(handle, problem)
                session.end(time.monotonic())
            else:
                return None
            self.loop.touch(handle)
        return None

    async def _refuse(self, ws: web.WebSocketResponse, code: str, message: str,
                      close_code: int, session_id: str | None = None) -> web.WebSocketResponse:
        self._log.info("session_refused", session_id=session_id, code=code, message=message)
        await ws.send_json({"type": "error", "code": code, "message": message})
        await ws.close(code=close_code)
        return ws

    def _reject(self, handle: SessionHandle, message: str) -> None:
        handle.send([{"type": "error", "code": "bad_request", "message": message}])
        handle.post(Close(CLOSE_POLICY))
        handle.abandoned = True
        handle.session.ended = True
        self.loop.touch(handle)


def _session_params(request: web.Request) -> tuple[str, int]:
    session_id = request.query.get("session_id") or uuid.uuid4().hex
    try:
        rate = int(request.query.get("sample_rate", "16000"))
    except ValueError:
        raise BadRequest("sample_rate must be an integer") from None
    if not MIN_RATE <= rate <= MAX_RATE:
        raise BadRequest(f"sample_rate must be {MIN_RATE}-{MAX_RATE} Hz, got {rate}")
    return session_id, rate


def _audio_problem(data: bytes, ended: bool) -> str | None:
    if ended:
        return "audio after end"
    if len(data) % 2:
        return f"PCM s16le needs an even byte count, got {len(data)}"
    return None


def _control_problem(data: str, ended: bool) -> str | None:
    try:
        message = json.loads(data)
    except ValueError:
        return "text frames must be JSON"
    if not isinstance(message, dict) or message.get("type") != "end":
        return "unknown control message; expected {\"type\":\"end\"}"
    if ended:
        return "end sent twice"
    return None


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
