"""``GET /v1/stream``: a live speech stream relayed to a realtime worker.

One ``StreamSession`` per WebSocket: authenticate, validate the query, count
the stream against its API key, open a worker session, send ``ready``, then
relay both ways until ``done``, an error, or either side leaving.

* client -> gateway: binary PCM s16le mono frames at ``sample_rate`` (even
  length, at most ``max_frame_bytes``); text ``{"type":"end"}``.
* gateway -> client: ``ready``, the worker's ``partial``/``final``/``error``
  (public fields only), ``done``; then close (1000, or the error's close code).

Malformed input ends only that session: an ``error`` event, then a close with
1008 (policy), 1009 (frame too large), 1011 (internal / worker lost) or 1013
(overloaded). Limits that end a healthy stream (``idle_timeout_s``,
``max_session_s``) end it gracefully: the worker is told ``end``, its last finals
are relayed, then ``error``/``timeout`` and close 1008.

Frames larger than ``max_frame_bytes`` get ``too_large`` and close 1009. The
WebSocket layer itself refuses frames over ``FRAME_HARD_CAP`` x that size at the
frame header (never buffering them); those close 1009 with no event.

Latency metrics use the gateway's own clock: a compact timeline of (cumulative
audio ms, arrival time) per received frame, trimmed as events pass, maps each
event's ``audio_end_ms`` back to when that audio arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

from aiohttp import WSMsgType, web
from redis.exceptions import RedisError

from gateway.auth import acquire_session, authenticate, refresh_session, release_session
from gateway.errors import json_error
from gateway.state import REDIS, SETTINGS, SOCKETS
from gateway.workers_client import (
    NoWorkers,
    Overloaded,
    WorkerLost,
    WorkerSession,
    open_worker_session,
)
from lanegate import metrics
from lanegate.constants import (
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    CLOSE_OVERLOADED,
    CLOSE_POLICY,
    CLOSE_TOO_LARGE,
    SAMPLE_WIDTH,
)
from lanegate.logs import get_logger

log = get_logger("gateway.stream")

MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 48000
#: the WebSocket layer refuses frames over this multiple of ``max_frame_bytes`` outright
FRAME_HARD_CAP = 2
#: close code when the gateway itself goes away (RFC 6455 "going away")
CLOSE_GOING_AWAY = 1001
LANGUAGE_RE = re.compile(r"^[A-Za-z]{2,3}([-_][A-Za-z0-9]{1,8})*$")

#: close code for each error ``code`` (worker errors included)
CLOSE_FOR_CODE = {
    "bad_request": CLOSE_POLICY,
    "unauthorized": CLOSE_POLICY,
    "timeout": CLOSE_POLICY,
    "too_large": CLOSE_TOO_LARGE,
    "overloaded": CLOSE_OVERLOADED,
    "worker_lost": CLOSE_INTERNAL,
    "internal": CLOSE_INTERNAL,
}
#: public fields of each worker event; anything else is internal and dropped
PUBLIC_FIELDS = {
    "partial": ("type", "segment", "text", "audio_end_ms"),
    "final": ("type", "segment", "text", "start_ms", "end_ms", "cut", "audio_end_ms", "words"),
    "error": ("type", "code", "message"),
    "done": ("type",),
}

SESSIONS: web.AppKey[set[StreamSession]] = web.AppKey("stream_sessions")


@dataclass(frozen=True)
class Failure:
    """Why a session ends abnormally: the ``error`` event and the close code."""

    code: str
    message: str
    graceful: bool = False  # relay the worker's last finals before the error

    @property
    def close_code(self) -> int:
        return CLOSE_FOR_CODE.get(self.code, CLOSE_INTERNAL)


class Timeline:
    """(cumulative audio ms, arrival time) per received frame, trimmed as events pass."""

    def __init__(self, sample_rate: int, maxlen: int = 20_000) -> None:
        self._bytes_per_ms = sample_rate * SAMPLE_WIDTH / 1000.0
        self._entries: deque[tuple[float, float]] = deque(maxlen=maxlen)
        self.audio_bytes = 0
        self.first_arrival: float | None = None
        self.last_arrival: float | None = None

    @property
    def audio_ms(self) -> float:
        return self.audio_bytes / self._bytes_per_ms

    def ms_of(self, nbytes: int) -> float:
        return nbytes / self._bytes_per_ms

    def add(self, nbytes: int, now: float) -> None:
        self.audio_bytes += nbytes
        self._entries.append((self.audio_ms, now))
        if self.first_arrival is None:
            self.first_arrival = now
        self.last_arrival = now

    def arrival_of(self, audio_end_ms: float) -> float | None:
        """When the frame holding ``audio_end_ms`` arrived (entries before it are dropped)."""
        entries = self._entries
        while len(entries) > 1 and entries[0][0] < audio_end_ms:
            entries.popleft()
        if not entries:
            return None
        return entries[0][1]


def _reject_http(request: web.Request) -> None:
    raise json_error(426, "bad_request", "/v1/stream needs a WebSocket upgrade",
                     headers={"Upgrade": "websocket"})


def parse_query(request: web.Request) -> tuple[int, str] | Failure:
    raw_rate = request.query.get("sample_rate", "16000")
    try:
        rate = int(raw_rate)
    except ValueError:
        return Failure("bad_request", f"sample_rate must be an integer, got {raw_rate!r}")
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        return Failure("bad_request",
                       f"sample_rate must be {MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE}, got {rate}")
    language = request.query.get("language", "en")
    if not LANGUAGE_RE.match(language):
        return Failure("bad_request", f"language must be a language tag, got {language!r}")
    return rate, language


def public_event(event: dict[str, Any]) -> dict[str, Any] | None:
    fields = PUBLIC_FIELDS.get(event["type"])
    if fields is None:
        return None
    return {k: event[k] for k in fields if k in event}


class StreamSession:
    """One public stream from upgrade to close."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse) -> None:
        self.request = request
        self.ws = ws
        self.settings = request.app[SETTINGS]
        self.redis = request.app[REDIS]
        self.session_id = uuid.uuid4().hex
        self.tenant: str | None = None
        self.lane = "realtime"
        self.worker: WorkerSession | None = None
        self.timeline: Timeline | None = None
        self.ended = False  # no more audio goes to the worker
        self.shutting_down = False
        self.first_partial_seen = False
        self.lease_held = False
        self.started = time.monotonic()
        self.log = log.bind(session_id=self.session_id, lane=self.lane)
        self.finished = asyncio.Event()

    # --- sending ---------------------------------------------------------------

    async def send(self, event: dict[str, Any]) -> bool:
        if self.ws.closed:
            return False
        try:
            await self.ws.send_str(json.dumps(event, separators=(",", ":")))
        except (ConnectionError, RuntimeError):
            return False
        return True

    async def close(self, code: int, message: str = "") -> None:
        await self._release_lease()  # before the client sees the close: it may reconnect
        if not self.ws.closed:
            with contextlib.suppress(ConnectionError, RuntimeError, TimeoutError):
                await self.ws.close(code=code, message=message.encode()[:120])

    async def reject(self, failure: Failure) -> None:
        """Refuse the session before it starts (counted as a rejection)."""
        metrics.REJECTIONS.labels(lane=self.lane, reason=failure.code).inc()
        self.log.info("stream_rejected", code=failure.code, reason=failure.message)
        await self.send({"type": "error", "code": failure.code, "message": failure.message})
        await self.close(failure.close_code, failure.code)

    # --- lifecycle -------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.finished.set()

    async def _run(self) -> None:
        self.tenant = authenticate(self.request)
        if self.tenant is None:
            await self.reject(Failure("unauthorized", "missing or invalid API key"))
            return
        parsed = parse_query(self.request)
        if isinstance(parsed, Failure):
            await self.reject(parsed)
            return
        sample_rate, language = parsed
        try:
            if not await acquire_session(self.redis, self.settings, self.tenant,
                                         self.session_id):
                await self.reject(Failure(
                    "overloaded", "this API key already has max_sessions_per_key "
                    f"({self.settings.max_sessions_per_key}) streams open"))
                return
        except RedisError:
            await self.reject(Failure("overloaded", "service unavailable; try again later"))
            return
        self.lease_held = True
        try:
            await self._with_worker(sample_rate, language)
        finally:
            await self._release_lease()

    async def _release_lease(self) -> None:
        if self.lease_held and self.tenant is not None:
            self.lease_held = False
            with contextlib.suppress(RedisError):
                await release_session(self.redis, self.settings, self.tenant, self.session_id)

    async def _with_worker(self, sample_rate: int, language: str) -> None:
        try:
            self.worker = await open_worker_session(
                self.request.app, session_id=self.session_id, sample_rate=sample_rate,
                language=language)
        except NoWorkers as exc:
            await self.reject(Failure("overloaded", f"{exc}; try again later"))
            return
        except Overloaded as exc:
            await self.reject(Failure("overloaded", f"{exc}; try again later"))
            return
        except RedisError:
            await self.reject(Failure("overloaded", "service unavailable; try again later"))
            return
        self.lane = self.worker.lane
        self.log = self.log.bind(lane=self.lane, worker=self.worker.worker_id)
        self.timeline = Timeline(sample_rate)
        try:
            if not await self.send({"type": "ready", "session_id": self.session_id,
                                    "lane": self.lane, "sample_rate": sample_rate}):
                return
            self.log.info("stream_start", sample_rate=sample_rate, language=language,
                          tenant=self.tenant)
            outcome = await self._relay()
            self._log_end(outcome)
        finally:
            await self.worker.close()

    def _log_end(self, outcome: Failure | str) -> None:
        assert self.timeline is not None
        fields: dict[str, Any] = {
            "duration_s": round(time.monotonic() - self.started, 3),
            "audio_s": round(self.timeline.audio_ms / 1000.0, 3),
        }
        if isinstance(outcome, Failure):
            self.log.info("stream_end", outcome="error", code=outcome.code,
                          reason=outcome.message, **fields)
        else:
            self.log.info("stream_end", outcome=outcome, **fields)

    async def _relay(self) -> Failure | str:
        """Run both directions; the outcome is "done", "client_gone" or a Failure."""
        client = asyncio.create_task(self._pump_client(), name=f"client-{self.session_id}")
        worker = asyncio.create_task(self._pump_worker(), name=f"worker-{self.session_id}")
        idle = asyncio.create_task(self._watch_idle(), name=f"idle-{self.session_id}")
        lease = asyncio.create_task(self._refresh_lease(), name=f"lease-{self.session_id}")
        tasks = (client, worker, idle, lease)
        try:
            await asyncio.wait({client, worker, idle}, return_when=asyncio.FIRST_COMPLETED)
            if worker.done():
                outcome = worker.result()
            else:
                outcome = client.result() if client.done() else idle.result()
                client.cancel()  # no more reads once the client side has an outcome
                if isinstance(outcome, Failure) and outcome.graceful:
                    outcome = await self._finish_gracefully(worker, outcome)
            await self._conclude(outcome)
            return outcome
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _finish_gracefully(
        self, worker: asyncio.Task[Failure | str], failure: Failure
    ) -> Failure | str:
        """End the worker's audio, relay its last finals, then report ``failure``."""
        assert self.worker is not None
        if not self.ended:
            self.ended = True
            try:
                await self.worker.end()
            except WorkerLost:
                return failure
        try:
            result = await asyncio.wait_for(asyncio.shield(worker),
                                            self.settings.drain_timeout_s)
        except TimeoutError:
            return failure
        if isinstance(result, Failure) and not result.graceful:
            return result
        return failure

    async def _conclude(self, outcome: Failure | str) -> None:
        if outcome == "client_gone":  # answer the client's close only now (autoclose off),
            await self.close(CLOSE_NORMAL)  # after the lease is released
            return
        if outcome == "done":
            await self.send({"type": "done"})
            await self.close(CLOSE_GOING_AWAY if self.shutting_down else CLOSE_NORMAL)
            return
        assert isinstance(outcome, Failure)
        if outcome.code in ("bad_request", "too_large", "timeout"):
            metrics.REJECTIONS.labels(lane=self.lane, reason=outcome.code).inc()
        await self.send({"type": "error", "code": outcome.code, "message": outcome.message})
        await self.close(outcome.close_code, outcome.code)

    # --- client -> worker --------------------------------------------------------

    async def _pump_client(self) -> Failure | str:
        while True:
            msg = await self.ws.receive()
            if msg.type is WSMsgType.BINARY:
                failure = await self._on_audio(msg.data)
            elif msg.type is WSMsgType.TEXT:
                failure = await self._on_control(msg.data)
            elif msg.type is WSMsgType.ERROR and self.ws.close_code == CLOSE_TOO_LARGE:
                return Failure("too_large", "frame larger than the hard cap")
            else:  # CLOSE / CLOSING / CLOSED / ERROR: the client left
                return "client_gone"
            if failure is not None:
                return failure

    async def _watch_idle(self) -> Failure:
        """``idle_timeout_s`` without audio ends the stream. One timer per idle period,
        not one per frame: at hundreds of streams, a timeout armed and cancelled around
        every read was a measurable share of the gateway's CPU."""
        assert self.timeline is not None
        while True:
            if self.ended:  # waiting for the worker's last finals; no audio expected
                await asyncio.get_running_loop().create_future()  # until cancelled
            last = self.timeline.last_arrival or self.started
            left = last + self.settings.idle_timeout_s - time.monotonic()
            if left <= 0:
                return Failure("timeout", f"no audio for {self.settings.idle_timeout_s:g} s "
                               "(idle_timeout_s)", graceful=True)
            await asyncio.sleep(left)

    async def _on_audio(self, data: bytes) -> Failure | None:
        assert self.timeline is not None
        assert self.worker is not None
        settings = self.settings
        if self.ended:
            if self.shutting_down:
                return None  # the gateway is draining this session; drop late audio
            return Failure("bad_request", "audio after {\"type\":\"end\"}")
        if len(data) > settings.max_frame_bytes:
            return Failure("too_large", f"frame of {len(data)} bytes is over max_frame_bytes "
                           f"({settings.max_frame_bytes})")
        if len(data) % SAMPLE_WIDTH:
            return Failure("bad_request", f"odd byte count {len(data)}: audio must be "
                           "PCM s16le, 2 bytes per sample")
        if not data:
            return None
        frame_ms = self.timeline.ms_of(len(data))
        if self.timeline.audio_ms + frame_ms > settings.max_session_s * 1000.0:
            return Failure("timeout", f"session audio over max_session_s "
                           f"({settings.max_session_s:g} s)", graceful=True)
        self.timeline.add(len(data), time.monotonic())
        try:
            await self.worker.send_audio(data)
        except WorkerLost:
            self.ended = True  # the worker pump reports the loss
        return None

    async def _on_control(self, data: str) -> Failure | None:
        assert self.worker is not None
        try:
            message = json.loads(data)
        except ValueError:
            return Failure("bad_request", "text frames must be JSON control messages; "
                           "audio goes in binary frames")
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            return Failure("bad_request", 'control messages are objects with a "type"')
        if message["type"] != "end":
            return Failure("bad_request", f"unknown message type {message['type']!r}")
        if not self.ended:
            self.ended = True
            with contextlib.suppress(WorkerLost):
                await self.worker.end()
        return None

    # --- worker -> client --------------------------------------------------------

    async def _pump_worker(self) -> Failure | str:
        assert self.worker is not None
        try:
            async for event in self.worker.events():
                kind = event["type"]
                if kind == "done":
                    return "done"
                if kind == "error":
                    return Failure(str(event.get("code") or "internal"),
                                   str(event.get("message") or "worker error"))
                out = public_event(event)
                if out is None:
                    continue
                self._observe(kind, out)
                if not await self.send(out):
                    return "client_gone"
        except WorkerLost as exc:
            self.log.warning("worker_lost", reason=str(exc))
            return Failure("worker_lost", "the realtime worker serving this stream was lost; "
                           "reconnect to continue")
        return Failure("worker_lost", "the worker ended the session without done")

    def _observe(self, kind: str, event: dict[str, Any]) -> None:
        assert self.timeline is not None
        now = time.monotonic()
        if kind == "partial" and not self.first_partial_seen:
            self.first_partial_seen = True
            if self.timeline.first_arrival is not None:
                metrics.FIRST_PARTIAL.labels(lane=self.lane).observe(
                    now - self.timeline.first_arrival)
        end_ms = event.get("audio_end_ms")
        if not isinstance(end_ms, int | float) or kind not in ("partial", "final"):
            return
        arrival = self.timeline.arrival_of(float(end_ms))
        if arrival is None:
            return
        histogram = metrics.PARTIAL_LATENCY if kind == "partial" else metrics.FINAL_LATENCY
        histogram.labels(lane=self.lane).observe(max(0.0, now - arrival))

    async def _refresh_lease(self) -> None:
        assert self.tenant is not None
        period = max(0.1, self.settings.session_lease_s / 3)
        while True:
            await asyncio.sleep(period)
            with contextlib.suppress(RedisError):
                await refresh_session(self.redis, self.settings, self.tenant, self.session_id)

    # --- gateway shutdown --------------------------------------------------------

    async def shutdown(self) -> None:
        """Gateway going away: end the audio, let the last finals out, close 1001."""
        self.shutting_down = True
        if self.worker is not None and not self.ended:
            self.ended = True
            with contextlib.suppress(WorkerLost):
                await self.worker.end()


async def stream_handler(request: web.Request) -> web.StreamResponse:
    """``GET /v1/stream``: upgrade, then run one ``StreamSession``."""
    settings = request.app[SETTINGS]
    ws = web.WebSocketResponse(max_msg_size=settings.max_frame_bytes * FRAME_HARD_CAP,
                               autoclose=False)
    if not ws.can_prepare(request).ok:
        _reject_http(request)
    await ws.prepare(request)
    session = StreamSession(request, ws)
    request.app[SOCKETS].add(ws)
    request.app[SESSIONS].add(session)
    try:
        await session.run()
    except Exception:
        session.log.exception("stream_internal_error")
        await session.send({"type": "error", "code": "internal",
                            "message": "internal gateway error"})
        await session.close(CLOSE_INTERNAL, "internal")
    finally:
        request.app[SOCKETS].discard(ws)
        request.app[SESSIONS].discard(session)
    return ws


async def drain_sessions(app: web.Application) -> None:
    """``on_shutdown``: give every live stream its last finals, then close 1001.

    Sessions get ``drain_timeout_s`` to finish; any still open are closed with an
    ``internal`` error ("gateway shutting down").
    """
    live: set[StreamSession] = app[SESSIONS]
    sessions = list(live)
    for session in sessions:
        await session.shutdown()
    waits = [asyncio.create_task(s.finished.wait()) for s in sessions]
    if waits:
        await asyncio.wait(waits, timeout=app[SETTINGS].drain_timeout_s)
        for wait in waits:
            wait.cancel()
    for session in sessions:
        if not session.finished.is_set():
            await session.send({"type": "error", "code": "internal",
                                "message": "gateway shutting down; reconnect"})
            await session.close(CLOSE_GOING_AWAY, "shutting down")


def setup_stream(app: web.Application) -> None:
    """Register ``/v1/stream`` and its shutdown drain on ``app``."""
    sessions: set[StreamSession] = set()
    app[SESSIONS] = sessions
    app.router.add_get("/v1/stream", stream_handler)
    app.on_shutdown.append(drain_sessions)
