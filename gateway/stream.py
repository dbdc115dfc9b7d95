"""``GET /v1/stream``: a live speech stream relayed to a realtime worker.

One ``StreamSession`` per WebSocket: authenticate, validate the query
(``sample_rate``, ``language``: ``gateway/params.py``), count the stream against
its API key, open a worker session, send ``ready``, then hand over to a
``Relay`` (``gateway/relay.py``) until ``done``, an error, or either side leaving.

A refusal before ``ready`` is an ``error`` event and the close code of its
``Failure``. The protocol and its close codes: docs/ARCHITECTURE.md, "A stream's
life".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

from aiohttp import WSCloseCode, web
from redis.exceptions import RedisError

from gateway.auth import ANONYMOUS, authenticate, lease_member, lease_subject
from gateway.errors import json_error
from gateway.intake import UploadError
from gateway.params import parse_language, parse_sample_rate
from gateway.relay import Failure, Outcome, Relay
from gateway.state import LEASES, SETTINGS, SOCKETS, STREAMS
from gateway.workers_client import (
    NoWorkers,
    Overloaded,
    VadOverrides,
    WorkerSession,
    open_worker_session,
)
from lanegate import metrics
from lanegate.logs import get_logger

log = get_logger("gateway.stream")

#: the WebSocket layer refuses frames over this multiple of ``max_frame_bytes`` at the
#: frame header, before buffering the payload (close 1009, no event: none can follow
#: its close frame); frames between the two get a ``too_large`` event from the relay
FRAME_HARD_CAP = 2


def _reject_http(request: web.Request) -> None:
    raise json_error(426, "bad_request", "/v1/stream needs a WebSocket upgrade",
                     headers={"Upgrade": "websocket"})


def parse_query(request: web.Request) -> tuple[int, str] | Failure:
    try:
        return (parse_sample_rate(request.query.get("sample_rate")),
                parse_language(request.query.get("language")))
    except UploadError as exc:
        return Failure("bad_request", exc.message)


class StreamSession:
    """One public stream from upgrade to close: admission and the lease here, the
    relay itself in a ``Relay`` once a worker session is open."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse) -> None:
        self.request = request
        self.ws = ws
        self.settings = request.app[SETTINGS]
        self.leases = request.app[LEASES]
        self.session_id = uuid.uuid4().hex
        self.lease_id = lease_member(request.app, self.session_id)  # in the per-key count
        self.worker_session_id = self.session_id  # the id the worker knows it by
        self.reopens = 0
        self.lane = "realtime"
        self.relay: Relay | None = None  # set while relaying
        self.lease_tenant: str | None = None  # the API key whose session lease is held
        self.shutting_down = False
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
        await self.send(self.error_event(failure.code, failure.message))
        await self.close(failure.close_code, failure.code)

    def error_event(self, code: str, message: str) -> dict[str, Any]:
        """The ``error`` event of this protocol."""
        return {"type": "error", "code": code, "message": message}

    # --- lifecycle -------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.finished.set()

    async def _run(self) -> None:
        tenant = self.authenticate()
        if tenant is None:
            await self.reject(Failure("unauthorized", "missing or invalid API key"))
            return
        parsed = self.params()
        if isinstance(parsed, Failure):
            await self.reject(parsed)
            return
        sample_rate, language = parsed
        subject = lease_subject(self.request, tenant)
        try:
            at_limit = await self.leases.admit(subject, self.lease_id)
        except RedisError:
            await self.reject(Failure("overloaded", "service unavailable; try again later"))
            return
        if at_limit is not None:
            await self.reject(Failure("overloaded", self._limit_message(tenant, at_limit)))
            return
        self.lease_tenant = subject
        try:
            await self.serve(tenant, sample_rate, language)
        finally:
            await self._release_lease()

    def _limit_message(self, tenant: str, limit: int) -> str:
        who = "this client address (auth is off)" if tenant == ANONYMOUS else "this API key"
        return (f"{who} already holds its limit of {limit} realtime sessions "
                f"(max_sessions_per_key {self.settings.max_sessions_per_key}, at most "
                f"max_key_share {self.settings.max_key_share:g} of the live slots)")

    # --- the seams a session of another public protocol overrides ---------------------
    def authenticate(self) -> str | None:
        """The caller's tenant, or None for a missing or wrong key."""
        return authenticate(self.request)

    def params(self) -> tuple[int, str] | Failure:
        """``(sample_rate, language)`` from the request, or why it is refused."""
        return parse_query(self.request)

    async def _release_lease(self) -> None:
        tenant, self.lease_tenant = self.lease_tenant, None
        if tenant is not None:
            with contextlib.suppress(RedisError):
                await self.leases.release(tenant, self.lease_id)

    async def serve(self, tenant: str, sample_rate: int, language: str) -> None:
        """Admitted, the lease taken (and kept fresh by ``app[LEASES]``): open the worker
        session and relay until the end."""
        worker = await self.open_worker(sample_rate, language)
        if worker is None:
            return
        relay = Relay(self, worker, session_id=self.session_id, sample_rate=sample_rate,
                      reopen=lambda lost: self._worker_session(sample_rate, language, lost),
                      settings=self.settings, started=self.started)
        self.lane, self.log, self.relay = relay.lane, relay.log, relay
        try:
            if not await self.send({"type": "ready", "session_id": self.session_id,
                                    "lane": self.lane, "sample_rate": sample_rate}):
                return
            self.log.info("stream_start", sample_rate=sample_rate, language=language,
                          tenant=tenant)
            await relay.run()
        finally:
            self.log_end()
            await relay.worker.close()

    async def _worker_session(self, sample_rate: int, language: str,
                              exclude: frozenset[str] = frozenset(),
                              vad: VadOverrides | None = None) -> WorkerSession:
        return await open_worker_session(
            self.request.app, session_id=self.worker_session_id, sample_rate=sample_rate,
            language=language, vad=vad, exclude=exclude)

    async def open_worker(self, sample_rate: int, language: str,
                          vad: VadOverrides | None = None) -> WorkerSession | None:
        """The worker session, or None once the client has been refused."""
        try:
            return await self._worker_session(sample_rate, language, vad=vad)
        except (NoWorkers, Overloaded) as exc:
            await self.reject(Failure("overloaded", f"{exc}; try again later"))
        except RedisError:
            await self.reject(Failure("overloaded", "service unavailable; try again later"))
        return None

    @property
    def outcome(self) -> Outcome | None:
        """How the relay ended; None before it has (or when it never began)."""
        return None if self.relay is None else self.relay.outcome

    def log_end(self) -> None:
        """``stream_end`` with the relay's outcome, once it has one: also when the client
        hung up right after the close and so cancelled the rest of the session."""
        relay, outcome = self.relay, self.outcome
        if relay is None or outcome is None:
            return
        fields: dict[str, Any] = {
            "duration_s": round(time.monotonic() - self.started, 3),
            "audio_s": round(relay.timeline.audio_ms / 1000.0, 3),
            "failovers": relay.failovers,
        }
        log = relay.log  # bound to the worker that served the end (after a failover)
        if isinstance(outcome, Failure):
            log.info("stream_end", outcome="error", code=outcome.code,
                     reason=outcome.message, **fields)
        else:
            log.info("stream_end", outcome=outcome.value, **fields)

    async def shutdown(self) -> None:
        """Gateway going away: end the audio, let the last finals out, close 1001."""
        self.shutting_down = True
        if self.relay is not None:
            await self.relay.end_audio()


async def stream_handler(request: web.Request) -> web.StreamResponse:
    """``GET /v1/stream``: upgrade, then run one ``StreamSession``."""
    settings = request.app[SETTINGS]
    ws = web.WebSocketResponse(max_msg_size=settings.max_frame_bytes * FRAME_HARD_CAP,
                               autoclose=False)
    if not ws.can_prepare(request).ok:
        _reject_http(request)
    await ws.prepare(request)
    return await run_socket(request, StreamSession(request, ws))


async def run_socket(request: web.Request, session: StreamSession) -> web.WebSocketResponse:
    """Run ``session`` on its prepared socket, known to the shutdown drain meanwhile."""
    ws = session.ws
    request.app[SOCKETS].add(ws)
    request.app[STREAMS].add(session)
    try:
        await session.run()
    except asyncio.CancelledError:  # the client's connection dropped (handler_cancellation)
        if session.outcome is None:  # else log_end did
            session.log.info("stream_end", outcome="client_gone", reason="connection lost")
        raise
    except Exception:
        session.log.exception("stream_internal_error")
        await session.send(session.error_event("internal", "internal gateway error"))
        await session.close(WSCloseCode.INTERNAL_ERROR, "internal")
    finally:
        request.app[SOCKETS].discard(ws)
        request.app[STREAMS].discard(session)
    return ws


async def drain_sessions(app: web.Application) -> None:
    """``on_shutdown``: give every live stream its last finals, then close 1001.

    Sessions get ``drain_timeout_s`` to finish; any still open are closed with an
    ``internal`` error ("gateway shutting down").
    """
    live: set[StreamSession] = app[STREAMS]
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
            await session.send(session.error_event("internal",
                                                   "gateway shutting down; reconnect"))
            await session.close(WSCloseCode.GOING_AWAY, "shutting down")


def setup_stream(app: web.Application) -> None:
    """Register ``/v1/stream`` and its shutdown drain on ``app``."""
    sessions: set[StreamSession] = set()
    app[STREAMS] = sessions
    app.router.add_get("/v1/stream", stream_handler)
    app.on_shutdown.append(drain_sessions)
