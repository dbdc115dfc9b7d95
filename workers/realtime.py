"""The realtime (and mixed) worker: an internal WebSocket server around the step loop.
(Over 400 lines: its two endpoints and the mixed mode act on the same step loop.)

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
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis.asyncio as aioredis
from aiohttp import WSMsgType, web

from engines import Engine, EngineStream, NoFreeSlot, create_engine
from lanegate import metrics
from lanegate.constants import (
    CLOSE_GOING_AWAY,
    CLOSE_OVERLOADED,
    CLOSE_POLICY,
    LINK_PATH,
    WorkerLane,
)
from lanegate.logs import get_logger
from lanegate.redis_io import redis_client
from lanegate.settings import Settings
from lanes import registry
from lanes.cost import percentile
from lanes.session import Event, RealtimeSession, decode_options
from lanes.steploop import Close, SessionHandle, StepLoop
from vad import VadSettings
from workers import process
from workers.link import heartbeat_s, serve_link
from workers.process import (
    FLUSH_TIMEOUT_S,
    Handler,
    WorkerShell,
    default_worker_id,
    on_stop_signals,
    within,
)
from workers.validation import (
    BadRequest,
    Overloaded,
    Refused,
    SessionExists,
    audio_problem,
    control_problem,
    end_problem,
    memory_problem,
    session_params,
    session_vad,
    token_ok,
    token_refusal,
)
from workers.watchdog import EXIT_STALLED, stalled_step

SESSION_PATH = "/internal/v1/session"
# Event-loop lag probe period.
LAG_PROBE_S = 0.05


class RealtimeWorker:
    def __init__(self, settings: Settings, engine: Engine, redis: aioredis.Redis, *,
                 lane: WorkerLane = WorkerLane.REALTIME) -> None:
        if lane not in (WorkerLane.REALTIME, WorkerLane.MIXED):
            raise ValueError(f"a realtime worker serves lane realtime or mixed, not {lane!r}")
        lane = WorkerLane(lane)  # the tests pass plain strings
        self.settings = settings
        self.engine = engine
        self.redis = redis
        self.lane = lane
        self.worker_id = settings.worker_id or default_worker_id()
        self.loop = StepLoop(engine, settings, lane=lane, worker_id=self.worker_id)
        self.shell = WorkerShell(settings, redis, lane, self.worker_id, self.info)
        self.draining = False
        # a step outran step_stall_s (workers/watchdog.py): how long it had run, and
        # set once the worker has left the registry for it
        self.stall_s: float | None = None
        self.stalled = asyncio.Event()
        self.lag_s: list[float] = []
        self._stop = asyncio.Event()
        self._batch_stop = asyncio.Event()
        self._stopped = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._batch_task: asyncio.Task[None] | None = None
        self.links: set[web.WebSocketResponse] = set()  # open gateway links
        self._vad = VadSettings.from_settings(settings)
        self._log = get_logger("lanegate.worker", lane=lane, worker=self.worker_id)
        self._labels = {"lane": lane, "worker": self.worker_id}

    @property
    def url(self) -> str:
        return self.shell.url

    @property
    def port(self) -> int:
        return self.shell.port

    # --- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        app = self.shell.app(self._healthz, self._readyz)
        app.middlewares.append(self._internal_auth)
        app.router.add_get(SESSION_PATH, self._session)
        app.router.add_get(LINK_PATH, self._link)
        app.on_shutdown.append(self._close_links)
        await self.shell.start(app)
        self._loop_task = asyncio.create_task(self.loop.run(self._stop))
        self.shell.spawn(self._probe_lag())
        if self.lane is WorkerLane.REALTIME:  # a mixed worker's uncapped steps may take long
            self.shell.spawn(self._watch_steps())
        if self.lane is WorkerLane.MIXED:
            self._batch_task = asyncio.create_task(self._batch_consumer())
        self._log.info("worker_started", url=self.url, engine=self.engine.name,
                       slots=self.engine.slots_total, capped=self.loop.limits.capped)

    async def drain(self) -> None:
        """Stop taking sessions, let the active ones finish, flush the rest, stop."""
        if self.draining:
            return
        self.draining = True
        self._log.info("drain_started", sessions=len(self.loop.sessions))
        await self.shell.publish()
        if not await within(self.loop.idle.wait(), self.settings.drain_timeout_s):
            self._log.info("drain_timeout", sessions=len(self.loop.sessions))
            self.loop.flush_all()
            await within(self.loop.idle.wait(), FLUSH_TIMEOUT_S)
        await self.stop()

    async def stop(self) -> None:
        if self._stopped.is_set():
            return
        if self._batch_task is not None:
            # The consumer hands its unfinished jobs back; its last batch needs the loop.
            self._batch_stop.set()
            if not await within(asyncio.shield(self._batch_task), FLUSH_TIMEOUT_S):
                self._batch_task.cancel()
        self._stop.set()  # the step loop ends itself between steps
        await asyncio.gather(*[t for t in (self._loop_task, self._batch_task) if t],
                             return_exceptions=True)
        await self.shell.close()
        self._log.info("worker_stopped", **self.loop.stats(),
                       loop_lag_p99_ms=round(percentile(self.lag_s, 0.99) * 1000, 2),
                       loop_lag_max_ms=round(max(self.lag_s, default=0.0) * 1000, 2))
        self._stopped.set()

    async def _close_links(self, app: web.Application) -> None:
        """Tell each gateway that this worker is going (1001): an open link would stall
        the server's shutdown until the gateway gave up on it as silent."""
        for ws in list(self.links):
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.close(code=CLOSE_GOING_AWAY, message=b"worker stopping")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # --- registry and probes ---------------------------------------------------------
    def info(self) -> registry.WorkerInfo:
        return registry.WorkerInfo(
            worker_id=self.worker_id, lane=self.lane, url=self.url, engine=self.engine.name,
            slots_total=self.engine.slots_total, slots_free=self.engine.slots_free(),
            step_p99_ms=round(self.loop.step_p99_ms(), 2), draining=self.draining)

    def publish_soon(self) -> None:
        """Republish now: a slot was taken or freed."""
        if not self._stop.is_set():
            self.shell.publish_soon()

    async def _watch_steps(self) -> None:
        self.stall_s = await stalled_step(self.loop, self.settings.step_stall_s)
        self._log.error("step_stalled", step_s=round(self.stall_s, 3),
                        limit_s=self.settings.step_stall_s, sessions=len(self.loop.sessions))
        self.draining = True  # no new sessions
        await self.shell.leave_registry()
        self.stalled.set()

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
        consumer = batch.BatchConsumer(self.settings, self.redis, self.engine,
                                       lane=WorkerLane.MIXED,
                                       decode=self.loop.submit_batch, worker_id=self.worker_id)
        await consumer.run(self._batch_stop)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "worker": self.worker_id, "lane": self.lane})

    @web.middleware
    async def _internal_auth(self, request: web.Request, handler: Handler
                             ) -> web.StreamResponse:
        """``/internal/*`` only with the deployment's token (probes and metrics stay open)."""
        if request.path.startswith("/internal/") and not token_ok(self.settings,
                                                                  request.headers):
            self._log.warning("internal_unauthorized", path=request.path,
                              peer=request.remote)
            return web.json_response(
                {"error": {"code": "unauthorized",
                           "message": "missing or wrong internal token"}}, status=401)
        return await handler(request)

    async def _readyz(self, request: web.Request) -> web.Response:
        try:
            await self.redis.ping()
        except Exception as exc:
            return web.json_response({"status": "redis unreachable", "error": str(exc)},
                                     status=503)
        if self.stall_s is not None:
            return web.json_response({"status": "stalled"}, status=503)
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ready", "slots_free": self.engine.slots_free()})

    # --- sessions (both endpoints) ------------------------------------------------------
    def open_session(self, session_id: str, rate: int,
                     sink: Callable[[Event | Close], None] | None = None,
                     vad: object = None,
                     options: Mapping[str, Any] | None = None) -> SessionHandle:
        """A new session in the step loop; ``Overloaded`` while draining or full,
        ``BadRequest`` for bad ``vad`` settings (``validation.session_vad``) or options.
        ``options``: the gateway's ``language``, ``prompt``, ``temperature``, ``task``."""
        vad_settings = session_vad(vad, self._vad)
        if self.draining:
            raise Overloaded("worker is draining")
        held = self.loop.sessions.get(session_id)
        if held is not None and held.abandoned:
            self.loop.reclaim()  # the same id, abandoned just before: free it first
        if session_id in self.loop.sessions:
            raise SessionExists(session_id)
        try:
            stream = self._open_stream(options or {})
        except NoFreeSlot as exc:
            raise Overloaded(str(exc)) from None
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        session = RealtimeSession(session_id, rate, stream, vad_settings,
                                  int(self.settings.max_window_s * self.engine.sample_rate),
                                  vad_inline_samples=self.loop.vad_slice_samples,
                                  partial_interval_s=self.settings.partial_interval_ms / 1000)
        handle = self.loop.add(session, sink=sink)
        self.publish_soon()
        self._log.info("session_start", session_id=session_id, sample_rate=rate)
        return handle

    def _open_stream(self, options: Mapping[str, Any]) -> EngineStream:
        """An engine stream with the session's decoder options. A slot abandoned since
        the step loop last settled is still taken: when none is free, those (not the
        step's in flight) are freed and the slot asked for once more."""
        decode = decode_options(options.get("language"), options.get("prompt"),
                                options.get("temperature"), options.get("task"))
        try:
            return self.engine.open_stream(decode)
        except NoFreeSlot:
            if not self.loop.reclaim():
                raise
            return self.engine.open_stream(decode)

    def accepted(self) -> Event:
        return {"type": "accepted", "worker": self.worker_id, "lane": self.lane}

    def log_refusal(self, exc: Refused, session_id: str | None) -> None:
        self._log.info("session_refused", session_id=session_id, code=exc.code,
                       message=str(exc))

    def reject(self, handle: SessionHandle, message: str, code: str = "bad_request",
               close_code: int = CLOSE_POLICY) -> None:
        """End this session with an ``error`` (the gateway broke the protocol, or its
        client sends too fast), then close; other sessions are not touched."""
        handle.send([{"type": "error", "code": code, "message": message}])
        handle.post(Close(close_code))
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
        problem = memory_problem(handle.session, self.settings)
        if problem:
            self._log.warning("session_over_memory", session_id=handle.session.session_id,
                              message=problem)
            self.reject(handle, problem, "overloaded", CLOSE_OVERLOADED)
            return False
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

    def commit(self, handle: SessionHandle) -> None:
        """The gateway's ``commit``: the utterance ends at the audio received so far."""
        if not handle.session.ended:
            handle.session.commit()
            self.loop.touch(handle)

    def abandon(self, handle: SessionHandle) -> None:
        """The gateway's side of the session is gone: drop it and free its slot."""
        handle.abandoned = True
        handle.post(Close(CLOSE_POLICY))
        self.loop.touch(handle)

    # --- one session per WebSocket -------------------------------------------------------
    async def _session(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=self.settings.max_frame_bytes + 1024,
                                   heartbeat=heartbeat_s(self.settings))
        await ws.prepare(request)
        session_id = request.query.get("session_id")
        try:
            session_id, rate = session_params(session_id, request.query.get("sample_rate"))
            handle = self.open_session(session_id, rate, options=request.query)
        except Refused as exc:
            return await self._refuse(ws, exc, session_id)
        await ws.send_json(self.accepted())
        sender = asyncio.create_task(_send_outbox(ws, handle))
        try:
            await self._receive(ws, handle)
        finally:
            # the client is gone: a session it ended but that is not finished yet is
            # abandoned too, or the worker would decode its backlog for no one, holding
            # a slot and the step loop while new sessions wait
            if self.loop.sessions.get(handle.session.session_id) is handle:
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


# --- process entry ------------------------------------------------------------------
async def serve(settings: Settings, lane: WorkerLane) -> int:
    log = get_logger("lanegate.worker", lane=lane)
    refusal = token_refusal(settings)
    if refusal is not None:
        log.error("internal_token_missing", host=settings.worker_host, message=refusal)
        print(f"lanegate worker: {refusal}", file=sys.stderr)
        return 2
    engine = await asyncio.get_running_loop().run_in_executor(
        None, lambda: create_engine(settings, slots=settings.slots, batch=lane is WorkerLane.MIXED))
    redis = redis_client(settings.redis_url)
    worker = RealtimeWorker(settings, engine, redis, lane=lane)
    await worker.start()
    drains: set[asyncio.Task[None]] = set()
    on_stop_signals(lambda: drains.add(asyncio.create_task(worker.drain())))
    ended = [asyncio.create_task(worker.stalled.wait()),
             asyncio.create_task(worker.wait_stopped())]
    await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
    if worker.stalled.is_set():
        log.error("worker_exit", reason="step_stalled", code=EXIT_STALLED)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STALLED)  # the engine thread cannot be joined
    await redis.aclose()
    log.info("worker_exit")
    return 0


def main(settings: Settings, lane: WorkerLane = WorkerLane.REALTIME) -> int:
    return process.main(settings, lane, lambda s: serve(s, lane))
