"""``GET /v1/realtime?intent=transcription``: the OpenAI Realtime API's transcription
sessions, translated onto a realtime-lane session (README, "OpenAI Realtime API").

A ``RealtimeSession`` is a ``StreamSession`` (the same authentication, per-key lease,
admission and metrics as ``/v1/stream``) that speaks OpenAI's events: it opens the
worker session at once (refused at once when no slot is free), sends
``session.created``, applies ``session.update`` until the first audio (reopening the
worker session when the format, language or turn detection changes), then hands over
to a ``RealtimeRelay``: the ``Relay`` with OpenAI's client events in and the worker's
events translated by ``Items`` (``gateway/realtime_items.py``) out.

As at OpenAI, a bad client event is answered with an ``error`` event and the session
goes on; what ends a ``/v1/stream`` session (idle, ``max_session_s``, the gateway
shutting down, a lost worker when no other can take the session) ends this one with
an ``error`` and the same close code. A lost worker fails over as a ``/v1/stream``'s
does (``gateway/relay.py``); the replay repeats the commits no final has answered yet,
each after the same audio, so every committed item is completed once.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections.abc import Awaitable
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from gateway.errors import json_error
from gateway.realtime_config import ConfigError, TranscriptionConfig
from gateway.realtime_items import EventIds, Items
from gateway.relay import Ending, Failure, Outcome, Relay
from gateway.state import SETTINGS
from gateway.stream import FRAME_HARD_CAP, StreamSession, run_socket
from gateway.workers_client import WorkerSession
from lanegate import metrics

#: OpenAI refuses to commit less audio than this (``input_audio_buffer_commit_empty``)
MIN_COMMIT_MS = 100
#: client events that change the session
UPDATES = frozenset({"session.update", "transcription_session.update"})
#: base64 makes an append a third larger than its audio; JSON adds a little
APPEND_OVERHEAD = 4 / 3
APPEND_SLACK_BYTES = 4096
#: the ``type`` of an error by our ``code``; anything else is the server's fault
CLIENT_FAULTS = frozenset({"bad_request", "unauthorized", "too_large", "timeout",
                           "invalid_value", "unknown_parameter", "missing_required_parameter",
                           "input_audio_buffer_commit_empty", "unsupported"})


def _error_type(code: str) -> str:
    return "invalid_request_error" if code in CLIENT_FAULTS else "server_error"


def _client_event(data: str) -> dict[str, Any] | ConfigError:
    try:
        event = json.loads(data)
    except ValueError:
        return ConfigError("", "client events are JSON objects", "bad_request")
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        return ConfigError("type", 'client events are objects with a "type"', "bad_request")
    return event


class RealtimeSession(StreamSession):
    """One Realtime API WebSocket: the ``StreamSession`` lifecycle in OpenAI's events."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse) -> None:
        super().__init__(request, ws)
        self.ids = EventIds()
        self.config = TranscriptionConfig.initial(self.settings)
        # the beta API's clients send this header and expect its shape
        self.beta = "realtime=v1" in request.headers.get("OpenAI-Beta", "")
        self.worker: WorkerSession | None = None
        self.parked = False  # no worker session, before the first audio

    # --- StreamSession's seams -------------------------------------------------------
    def params(self) -> tuple[int, str] | Failure:
        intent = self.request.query.get("intent")
        if intent != "transcription":
            return Failure("bad_request", f"intent {intent!r} is not supported: lanegate "
                           "serves transcription sessions (?intent=transcription)")
        return self.config.rate, self.config.language

    def error_event(self, code: str, message: str, *, param: str | None = None,
                    event_id: str | None = None) -> dict[str, Any]:
        return {"type": "error", "event_id": self.ids.event(),
                "error": {"type": _error_type(code), "code": code, "message": message,
                          "param": param, "event_id": event_id}}

    async def serve(self, tenant: str, sample_rate: int, language: str) -> None:
        self.worker = await self.open_worker(sample_rate, language,
                                             self.config.vad_overrides())
        if self.worker is None:
            return
        try:
            self.log.info("stream_start", sample_rate=sample_rate, language=language,
                          tenant=tenant, protocol="openai-realtime")
            if not await self.send(self._session_event("created")):
                return
            first = await self._configure()
            if first is None:
                return
            config = self.config  # fixed from the first audio on

            def reopen(lost: frozenset[str]) -> Awaitable[WorkerSession]:
                return self._worker_session(config.rate, config.language, lost,
                                            vad=config.vad_overrides())

            relay = RealtimeRelay(self, self.worker, session_id=self.session_id,
                                  sample_rate=config.rate,
                                  settings=self.settings, started=self.started,
                                  reopen=reopen, park=True)
            self.lane, self.log, self.relay = relay.lane, relay.log, relay
            await relay.run_from(first)
        finally:
            self.log_end()
            self._parked(False)
            if self.worker is not None:
                await self.worker.close()
            if self.relay is not None:  # after a failover or a resume: another one
                await self.relay.worker.close()

    # --- before the first audio -----------------------------------------------------
    def _session_event(self, verb: str, *, beta: bool | None = None) -> dict[str, Any]:
        beta = self.beta if beta is None else beta
        kind = f"transcription_session.{verb}" if beta else f"session.{verb}"
        session = {"id": f"sess_{self.session_id}", **self.config.render(beta=beta)}
        return {"type": kind, "event_id": self.ids.event(), "session": session}

    async def _configure(self) -> str | None:
        """Apply updates until the first other client event (returned); None once the
        client is gone or refused. A client that waits (a push-to-talk client before
        its first turn) gives the worker session back after ``realtime_park_after_s``
        and gets one again with its first other event, as a parked relay does."""
        settings = self.settings
        last = time.monotonic()
        while True:
            close_at, failure = min(
                (last + settings.realtime_idle_timeout_s,
                 Failure("timeout", f"no audio or client event for "
                         f"{settings.realtime_idle_timeout_s:g} s (realtime_idle_timeout_s)")),
                (self.started + settings.realtime_max_session_s,
                 Failure("timeout", f"session open for realtime_max_session_s "
                         f"({settings.realtime_max_session_s:g} s)")),
                key=lambda c: c[0])
            wait = close_at
            if self.worker is not None:
                wait = min(wait, last + settings.realtime_park_after_s)
            try:
                msg = await self.ws.receive(timeout=max(0.001, wait - time.monotonic()))
            except TimeoutError:
                if time.monotonic() < close_at:  # park: the slot goes back
                    await self._release_worker()
                    continue
                await self.reject(failure)
                return None
            last = time.monotonic()
            if msg.type is WSMsgType.BINARY:
                await self.send(self.error_event(
                    "bad_request", "binary frames are not Realtime API events; send "
                    "input_audio_buffer.append with base64 audio"))
                continue
            if msg.type is not WSMsgType.TEXT:
                await self.close(WSCloseCode.OK)
                return None
            event = _client_event(msg.data)
            if isinstance(event, ConfigError):
                await self.send(self.error_event(event.code, str(event), param=event.param))
            elif event["type"] in UPDATES:
                if not await self._update_before_audio(event):
                    return None
            elif self.worker is None and not await self._reopen_worker():
                return None
            else:
                return str(msg.data)

    async def _release_worker(self) -> None:
        assert self.worker is not None
        await self.worker.close()
        self.worker = None
        self._parked(True)
        self.log.info("stream_parked", audio_s=0.0)

    def _parked(self, parked: bool) -> None:
        """Count the session in ``lanegate_parked_sessions`` while it waits without a
        worker session before its first audio."""
        if parked != self.parked:
            self.parked = parked
            metrics.PARKED_SESSIONS.labels(lane=self.lane).inc(1 if parked else -1)

    async def _reopen_worker(self) -> bool:
        """A worker session again, under a new id (the worker may not have dropped the
        old one yet); False once the client has been refused."""
        self._parked(False)
        self.reopens += 1
        self.worker_session_id = f"{self.session_id}-{self.reopens}"
        config = self.config
        self.worker = await self.open_worker(config.rate, config.language,
                                             config.vad_overrides())
        return self.worker is not None

    async def _update_before_audio(self, event: dict[str, Any]) -> bool:
        """Apply ``event``; False once the client has been refused (no worker)."""
        try:
            config = self.config.updated(event, self.settings)
        except ConfigError as exc:
            await self.send(self.error_event(exc.code, str(exc), param=exc.param,
                                             event_id=event.get("event_id")))
            return True
        reopen = config.worker_key() != self.config.worker_key()
        self.config = config
        if reopen and self.worker is not None:
            await self.worker.close()  # its slot first: the new session may need it
            # The worker drops an abandoned session at its next step, which may still be
            # running: the new one must not wait for that id to be free.
            if not await self._reopen_worker():
                return False
        await self.send(self._session_event(
            "updated", beta=event["type"] == "transcription_session.update"))
        return True

    def update_after_audio(self, event: dict[str, Any]) -> dict[str, Any]:
        """The answer to an update once audio flows: ``updated``, or an ``error`` for a
        change the open worker session cannot take."""
        try:
            config = self.config.updated(event, self.settings)
        except ConfigError as exc:
            return self.error_event(exc.code, str(exc), param=exc.param,
                                    event_id=event.get("event_id"))
        if config.format is not self.config.format \
                or config.worker_key() != self.config.worker_key():
            return self.error_event(
                "invalid_value", "the audio format, language and turn_detection cannot "
                "change once audio has been sent; open a new session", param="session",
                event_id=event.get("event_id"))
        self.config = config
        return self._session_event("updated",
                                   beta=event["type"] == "transcription_session.update")


class RealtimeRelay(Relay):
    """The relay phase in OpenAI's events (module docstring)."""

    client: RealtimeSession

    def __init__(self, client: RealtimeSession, worker: WorkerSession, **kwargs: Any) -> None:
        super().__init__(client, worker, **kwargs)
        self.client = client
        self.items = Items(client.ids, server_vad=client.config.turn_detection is not None)
        self.buffer_start_ms = 0.0  # audio before this is committed (or cleared)

    async def run_from(self, first: str) -> Outcome:
        """Handle the client event that ended the configuration, then relay."""
        failure = await self.on_text(first)
        if failure is not None:
            return await self.end(failure)
        return await self.run()

    # --- client -> worker ------------------------------------------------------------
    async def on_binary(self, data: bytes) -> Failure | None:
        await self._error("bad_request", "binary frames are not Realtime API events; send "
                          "input_audio_buffer.append with base64 audio")
        return None

    async def on_text(self, data: str) -> Failure | None:
        self.touch()
        event = _client_event(data)
        if isinstance(event, ConfigError):
            await self._error(event.code, str(event), param=event.param)
            return None
        kind, event_id = event["type"], event.get("event_id")
        if kind == "input_audio_buffer.append":
            return await self._append(event)
        if kind == "input_audio_buffer.commit":
            await self._commit(event_id)
        elif kind == "input_audio_buffer.clear":
            await self._clear()
        elif kind in UPDATES:
            await self.client.send(self.client.update_after_audio(event))
        else:
            await self._error("bad_request", f"client event {kind!r} is not supported in a "
                              "transcription session", param="type", event_id=event_id)
        return None

    async def _error(self, code: str, message: str, *, param: str | None = None,
                     event_id: Any = None) -> None:
        await self.client.send(self.client.error_event(
            code, message, param=param, event_id=event_id if isinstance(event_id, str)
            else None))

    async def _append(self, event: dict[str, Any]) -> Failure | None:
        event_id = event.get("event_id")
        audio = event.get("audio")
        if not isinstance(audio, str):
            await self._error("missing_required_parameter", "append needs audio: a base64 "
                              "string", param="audio", event_id=event_id)
            return None
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            await self._error("invalid_value", "audio is not valid base64", param="audio",
                              event_id=event_id)
            return None
        pcm = self.client.config.format.to_pcm(raw)
        if len(pcm) > self.settings.max_frame_bytes:
            await self._error("too_large", f"an append of {len(pcm)} bytes of PCM is over "
                              f"max_frame_bytes ({self.settings.max_frame_bytes}); send "
                              "smaller appends", param="audio", event_id=event_id)
            return None
        if len(pcm) % 2:
            await self._error("invalid_value", "audio/pcm is s16le: an even number of bytes",
                              param="audio", event_id=event_id)
            return None
        return await self._on_audio(pcm)

    async def _commit(self, event_id: Any) -> None:
        buffered = self.timeline.audio_ms - self.buffer_start_ms
        if buffered < MIN_COMMIT_MS:
            await self._error("input_audio_buffer_commit_empty",
                              f"buffer too small: a commit needs at least {MIN_COMMIT_MS} ms "
                              f"of audio, the buffer holds {buffered:.0f} ms",
                              event_id=event_id)
            return
        self.buffer_start_ms = self.timeline.audio_ms
        if await self._commit_worker():
            for out in self.items.commit(buffered / 1000):
                await self.client.send(out)

    async def _clear(self) -> None:
        if self.timeline.audio_ms > self.buffer_start_ms and await self._commit_worker():
            self.items.clear()
        self.buffer_start_ms = self.timeline.audio_ms
        await self.client.send({"type": "input_audio_buffer.cleared",
                                "event_id": self.client.ids.event()})

    async def _commit_worker(self) -> bool:
        return await self.commit()

    # --- worker -> client --------------------------------------------------------------
    async def forward(self, event: dict[str, Any]) -> bool:
        kind = event["type"]
        if kind == "speech_started":
            out = self.items.speech_started(int(event["segment"]), int(event["start_ms"]))
        elif kind == "speech_stopped":
            end_ms, cut = int(event["end_ms"]), str(event.get("cut"))
            if self.items.server_vad and cut != "commit":  # the audio before it is committed
                self.buffer_start_ms = max(self.buffer_start_ms, float(end_ms))
            out = self.items.speech_stopped(int(event["segment"]), end_ms, cut)
        elif kind == "partial":
            self._observe(kind, event)
            out = self.items.partial(int(event["segment"]), str(event["text"]))
        elif kind == "final":
            self._observe(kind, event)
            end_ms = int(event["end_ms"])
            if self.items.server_vad and event.get("cut") != "commit":  # a VAD cut: the
                self.buffer_start_ms = max(self.buffer_start_ms, float(end_ms))  # audio
                # before it is committed (without turn detection only a commit commits)
            out = self.items.final(int(event["segment"]), str(event["text"]),
                                   start_ms=int(event["start_ms"]), end_ms=end_ms,
                                   cut=str(event.get("cut")))
        else:
            return True
        for item in out:
            if not await self.client.send(item):
                return False
        return True

    async def conclude(self, outcome: Outcome) -> None:
        if isinstance(outcome, Failure):
            for event in self.items.failed(outcome.code, outcome.message):
                await self.client.send(event)
        if outcome is Ending.DONE:  # the gateway is draining: no "done" event in this API
            await self.client.close(WSCloseCode.GOING_AWAY if self.client.shutting_down
                                    else WSCloseCode.OK)
            return
        await super().conclude(outcome)


async def realtime_handler(request: web.Request) -> web.StreamResponse:
    """``GET /v1/realtime``: upgrade, then run one ``RealtimeSession``."""
    settings = request.app[SETTINGS]
    cap = int(settings.max_frame_bytes * FRAME_HARD_CAP * APPEND_OVERHEAD) + APPEND_SLACK_BYTES
    ws = web.WebSocketResponse(max_msg_size=cap, autoclose=False)
    if not ws.can_prepare(request).ok:
        raise json_error(426, "bad_request", "/v1/realtime needs a WebSocket upgrade",
                         headers={"Upgrade": "websocket"})
    await ws.prepare(request)
    return await run_socket(request, RealtimeSession(request, ws))


def setup_realtime_api(app: web.Application) -> None:
    """Register ``/v1/realtime`` (after ``setup_stream``: its sessions drain with those)."""
    app.router.add_get("/v1/realtime", realtime_handler)
