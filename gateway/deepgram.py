"""Deepgram's ``/v1/listen`` on the gateway's port: the live API (WebSocket) here, the
prerecorded one (POST) in ``gateway/deepgram_prerecorded.py``, translated onto the
same realtime sessions, uploads and jobs as lanegate's own API (README, "Deepgram API").
(Over 400 lines: the session, its socket reader and the channel relays share one
stream's state and Deepgram's message shapes.)

**Live.** The query (``gateway/deepgram_params.py``) and the key (``Authorization:
Token KEY``, ``Bearer KEY`` or ``Sec-WebSocket-Protocol: token, KEY``) are checked
before the upgrade: a refusal is an HTTP error in Deepgram's shape (``err_code``,
``err_msg``, ``request_id``; the message also in ``dg-error``). A ``DeepgramSession``
is a ``StreamSession`` (the same lease, admission, metrics and drain) that opens one
worker session per channel (``multichannel=true``: channel ``i`` of the interleaved
PCM is a live session of its own, with its own slot, VAD and finals, and counts
against the key's sessions; otherwise the channels are mixed into one). One reader
takes the socket: binary frames are decoded (``mulaw``/``alaw``), split by channel and
queued to each channel's ``ChannelRelay``, a ``Relay`` whose client side is that
reader; text frames are the controls ``KeepAlive``, ``Finalize`` (a commit on every
channel: the finals say ``from_finalize``) and ``CloseStream`` (the end of the audio:
the last finals, ``Metadata``, close 1000). A bad control message is answered with an
``Error`` and the stream goes on; bad audio ends it with an ``Error`` and Deepgram's
close code (DATA-0000: 1008; too large: 1009; no audio or KeepAlive for
``idle_timeout_s``, NET-0001: 1011).

Worker events become ``Results`` (partials only with ``interim_results``; their words
are spread over the audio they cover, as the engines time words only in finals),
``SpeechStarted`` (``vad_events``) and ``UtteranceEnd`` (``utterance_end_ms`` of audio
after the last final word with no new speech).

**KeepAlive** resets this adapter's own idle timer (``keepalive_deadline``, the
relay's ``deadline``) and ``Relay.touch``es every channel. A silent channel gives its
decoder slot back after ``realtime_park_after_s`` (the relay parks: ``park=True``,
``gateway/relay.py``) and takes one again at its next audio or ``Finalize``, so a
stretch of KeepAlive only holds no slot.

**Prerecorded** (``POST /v1/listen``, registered here): ``gateway/deepgram_prerecorded.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import Awaitable
from typing import Any

import numpy as np
from aiohttp import WSCloseCode, WSMsgType, web
from redis.exceptions import RedisError

from gateway.audio_formats import AudioFormat
from gateway.auth import authenticate, lease_subject
from gateway.deepgram_params import (
    TOKEN_PROTOCOL,
    DeepgramParams,
    check_key,
    http_error,
    params_or_400,
    presented_key,
)
from gateway.deepgram_prerecorded import transcribe
from gateway.relay import REJECTED_CODES, Ending, Failure, Outcome, Relay, Reopen, Timeline
from gateway.state import SETTINGS
from gateway.stream import FRAME_HARD_CAP, StreamSession, run_socket
from gateway.workers_client import NoWorkers, Overloaded, WorkerSession, open_worker_session
from lanegate import metrics
from lanegate.constants import SAMPLE_WIDTH
from lanegate.deepgram_response import (
    MODEL_INFO,
    MODEL_UUID,
    alternative,
    created_now,
    request_id,
    spread_words,
    timed_words,
)
from lanegate.settings import Settings

PATH = "/v1/listen"
#: Deepgram's error variant and close code for each ``Failure`` code
DG_ERRORS: dict[str, tuple[str, int]] = {
    "bad_request": ("DATA-0000", WSCloseCode.POLICY_VIOLATION),
    "too_large": ("DATA-0000", WSCloseCode.MESSAGE_TOO_BIG),
    "timeout": ("NET-0001", WSCloseCode.INTERNAL_ERROR),
    "unauthorized": ("INVALID_AUTH", WSCloseCode.POLICY_VIOLATION),
    "overloaded": ("OVERLOADED", WSCloseCode.TRY_AGAIN_LATER),
}
SERVER_ERROR = ("NET-0000", WSCloseCode.INTERNAL_ERROR)
#: how much of an unparseable control message an ``Error`` quotes back
QUOTE_CHARS = 200
#: the G.711 encodings, decoded to PCM s16le by the Realtime API's tables
G711 = {"mulaw": AudioFormat.PCMU, "alaw": AudioFormat.PCMA}


def keepalive_deadline(settings: Settings, started: float, timeline: Timeline,
                       keepalive_at: float) -> tuple[float, Failure]:
    """When a live stream that gets nothing more ends, and why: ``idle_timeout_s``
    after its last audio or ``KeepAlive``, ``max_session_wall_s`` after it opened, and
    the ``min_realtime_ratio`` rule of ``gateway.relay.stall_deadline`` counted from the
    last ``KeepAlive`` (a client that says it is silent on purpose is not a trickle)."""
    idle = settings.idle_timeout_s
    last = max(timeline.last_arrival or started, keepalive_at)
    since = max(started, keepalive_at)
    candidates = [
        (last + idle, Failure("timeout", f"no audio or KeepAlive for {idle:g} s "
                              "(idle_timeout_s)", graceful=True)),
        (started + settings.max_session_wall_s,
         Failure("timeout", f"stream open for max_session_wall_s "
                 f"({settings.max_session_wall_s:g} s)", graceful=True)),
    ]
    ratio = settings.min_realtime_ratio
    if ratio > 0:
        candidates.append((since + timeline.audio_ms / 1000.0 / ratio + idle, Failure(
            "timeout", f"audio arrives at under {ratio:g} x real time (min_realtime_ratio)",
            graceful=True)))
    return min(candidates, key=lambda c: c[0])


class ChannelRelay(Relay):
    """One channel's relay: audio from the session's reader, events out as Deepgram's."""

    def __init__(self, stream: DeepgramSession, worker: WorkerSession, index: int,
                 **kwargs: Any) -> None:
        super().__init__(stream, worker, **kwargs)
        self.stream = stream
        self.index = index
        self.starts: dict[int, float] = {}  # segment -> its speech start (s)
        self.next_start_s = 0.0  # where the segment after the last final starts
        self.last_word_end: float | None = None
        self.utterance_pending = False  # an UtteranceEnd is owed once enough audio passes

    @property
    def channel(self) -> list[int]:
        return [self.index, self.stream.dg.channels if self.stream.dg.multichannel else 1]

    # --- client side: the session's reader ------------------------------------------
    async def _pump_client(self) -> Outcome:
        return await asyncio.shield(self.stream.input_over)

    def deadline(self) -> tuple[float, Failure]:
        return keepalive_deadline(self.settings, self.started, self.timeline,
                                  self.stream.keepalive_at)

    async def conclude(self, outcome: Outcome) -> None:
        """Nothing here: the session tells the client once every channel is over."""

    # --- worker -> client -------------------------------------------------------------
    async def forward(self, event: dict[str, Any]) -> bool:
        kind = event["type"]
        dg = self.stream.dg
        if kind == "speech_started":
            start = int(event["start_ms"]) / 1000.0
            self.starts[int(event["segment"])] = start
            self.utterance_pending = False
            if dg.vad_events:
                return await self.stream.send({"type": "SpeechStarted",
                                               "channel": self.channel, "timestamp": start})
            return True
        if kind == "partial":
            self._observe(kind, event)
            if not dg.interim_results:
                return True
            start = self.starts.get(int(event["segment"]), self.next_start_s)
            end = max(start, float(event.get("audio_end_ms", 0)) / 1000.0)
            text = str(event["text"])
            return await self._results(start, end, text, spread_words(text, start, end),
                                       is_final=False)
        if kind == "final":
            return await self._final(event)
        return True

    async def _final(self, event: dict[str, Any]) -> bool:
        self._observe("final", event)
        segment = int(event["segment"])
        self.starts.pop(segment, None)
        start, end = int(event["start_ms"]) / 1000.0, int(event["end_ms"]) / 1000.0
        text, cut = str(event["text"]), str(event.get("cut"))
        words = timed_words(event.get("words") or ()) or spread_words(text, start, end)
        self.next_start_s = end
        if words:
            self.last_word_end = float(words[-1]["end"])
            self.utterance_pending = self.stream.dg.utterance_end_ms is not None
        language = str(event.get("language") or "") if self.stream.dg.multi else None
        sent = await self._results(start, end, text, words, is_final=True,
                                   speech_final=cut in ("endpoint", "end"),
                                   from_finalize=cut == "commit", language=language)
        return sent and await self.utterance_end()

    async def _results(self, start: float, end: float, text: str, words: list[dict[str, Any]],
                       *, is_final: bool, speech_final: bool = False,
                       from_finalize: bool = False, language: str | None = None) -> bool:
        return await self.stream.send({
            "type": "Results", "channel_index": self.channel,
            "duration": round(end - start, 3), "start": round(start, 3),
            "is_final": is_final, "speech_final": speech_final,
            "from_finalize": from_finalize,
            "channel": {"alternatives": [alternative(text, words, language or None)]},
            "metadata": {"request_id": self.stream.rid, "model_info": MODEL_INFO,
                         "model_uuid": MODEL_UUID},
        })

    async def utterance_end(self) -> bool:
        """``UtteranceEnd`` once ``utterance_end_ms`` of audio has passed the last final
        word with no new speech (checked at each final and each audio frame)."""
        gap = self.stream.dg.utterance_end_ms
        if not self.utterance_pending or gap is None or self.last_word_end is None:
            return True
        if self.timeline.audio_ms < self.last_word_end * 1000.0 + gap:
            return True
        self.utterance_pending = False
        return await self.stream.send({"type": "UtteranceEnd", "channel": self.channel,
                                       "last_word_end": self.last_word_end})

    # --- from the reader --------------------------------------------------------------
    async def audio(self, pcm: bytes) -> Failure | None:
        failure = await self._on_audio(pcm)
        if failure is None:
            await self.utterance_end()
        return failure


class DeepgramSession(StreamSession):
    """One Deepgram live WebSocket (module docstring)."""

    def __init__(self, request: web.Request, ws: web.WebSocketResponse,
                 dg: DeepgramParams, rid: str) -> None:
        super().__init__(request, ws)
        self.dg = dg
        self.rid = rid  # Deepgram's request_id (also in the handshake's dg-request-id)
        self.log = self.log.bind(request_id=rid)
        self.created = created_now()
        self.relays: list[ChannelRelay] = []
        self.input_over: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.keepalive_at = 0.0
        self.closing = False  # CloseStream came: later audio is dropped
        self.sha = hashlib.sha256()
        self.audio_bytes = 0
        self.extra_leases: list[str] = []
        self._send_lock = asyncio.Lock()
        self.format = G711.get(dg.encoding or "")

    # --- StreamSession's seams ----------------------------------------------------------
    def authenticate(self) -> str | None:
        return authenticate(self.request, presented_key(self.request))

    def params(self) -> tuple[int, str] | Failure:
        return self.dg.sample_rate, self.dg.language

    def error_event(self, code: str, message: str) -> dict[str, Any]:
        variant = DG_ERRORS.get(code, SERVER_ERROR)[0]
        return {"type": "Error", "variant": variant, "description": message,
                "message": "", "request_id": self.rid}

    async def send(self, event: dict[str, Any]) -> bool:
        async with self._send_lock:
            return await super().send(event)

    async def shutdown(self) -> None:
        self.shutting_down = True
        for relay in self.relays:
            await relay.end_audio()

    async def serve(self, tenant: str, sample_rate: int, language: str) -> None:
        workers = await self._open_all(tenant)
        if workers is None:
            return
        settings = self.settings
        for index, worker in enumerate(workers):
            self.relays.append(ChannelRelay(
                self, worker, index, session_id=self._channel_id(index),
                sample_rate=sample_rate, settings=settings, started=self.started,
                reopen=self._reopen(index), park=True))
        self.relay = self.relays[0]
        self.lane, self.log = self.relay.lane, self.relay.log
        self.log.info("stream_start", sample_rate=sample_rate, language=language,
                      tenant=tenant, protocol="deepgram", channels=len(workers))
        try:
            outcome = await self._relay_all()
            await self._conclude(outcome)
        finally:
            self.log_end()
            for relay in self.relays:
                await relay.worker.close()
            await self._release_extra()

    # --- opening ------------------------------------------------------------------------
    def _channel_id(self, index: int) -> str:
        return self.worker_session_id if self.dg.sessions == 1 \
            else f"{self.worker_session_id}-c{index}"

    def _open(self, index: int, exclude: frozenset[str] = frozenset()
              ) -> Awaitable[WorkerSession]:
        return open_worker_session(
            self.request.app, session_id=self._channel_id(index),
            sample_rate=self.dg.sample_rate, language=self.dg.language, vad=self.dg.vad,
            exclude=exclude, prompt=self.dg.prompt)

    def _reopen(self, index: int) -> Reopen:
        return lambda lost: self._open(index, lost)

    async def _open_all(self, tenant: str) -> list[WorkerSession] | None:
        """A worker session per channel (each but the first also leased against the
        key), or None once the client has been refused."""
        subject = lease_subject(self.request, tenant)
        workers: list[WorkerSession] = []
        try:
            for index in range(self.dg.sessions):
                if index:
                    member = f"{self.lease_id}#{index}"
                    at_limit = await self.leases.admit(subject, member)
                    if at_limit is not None:
                        raise Overloaded(self._limit_message(tenant, at_limit))
                    self.extra_leases.append(member)
                workers.append(await self._open(index))
        except (NoWorkers, Overloaded, RedisError) as exc:
            for worker in workers:
                await worker.close()
            await self._release_extra()
            reason = "service unavailable" if isinstance(exc, RedisError) else str(exc)
            await self.reject(Failure("overloaded", f"{reason}; try again later"))
            return None
        return workers

    async def _release_extra(self) -> None:
        members, self.extra_leases = self.extra_leases, []
        if members and self.lease_tenant is not None:
            for member in members:
                with contextlib.suppress(RedisError):
                    await self.leases.release(self.lease_tenant, member)

    # --- relaying -----------------------------------------------------------------------
    async def _relay_all(self) -> Outcome:
        reader = asyncio.create_task(self._read_all(), name=f"dg-reader-{self.session_id}")
        runs = {asyncio.create_task(r.run(), name=f"dg-{self.session_id}-{r.index}")
                for r in self.relays}
        try:
            pending = runs
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    outcome = task.result()
                    if isinstance(outcome, Failure) and not self.input_over.done():
                        self.input_over.set_result(outcome)  # the other channels end too
        finally:
            reader.cancel()
            for task in runs:
                task.cancel()
            await asyncio.gather(reader, *runs, return_exceptions=True)
        outcomes = [r.outcome for r in self.relays]
        failure = next((o for o in outcomes if isinstance(o, Failure)), None)
        if failure is not None:
            return failure
        return Ending.DONE if all(o is Ending.DONE for o in outcomes) else Ending.CLIENT_GONE

    async def _conclude(self, outcome: Outcome) -> None:
        for relay in self.relays:
            relay.outcome = outcome  # the session's outcome, for log_end
        if outcome is Ending.CLIENT_GONE:
            await self.close(WSCloseCode.OK)
            return
        if outcome is Ending.DONE:
            await self.send(self._metadata())
            await self.close(WSCloseCode.GOING_AWAY if self.shutting_down else WSCloseCode.OK)
            return
        if outcome.code in REJECTED_CODES:
            metrics.REJECTIONS.labels(lane=self.lane, reason=outcome.code).inc()
        variant, code = DG_ERRORS.get(outcome.code, SERVER_ERROR)
        await self.send(self.error_event(outcome.code, outcome.message))
        await self.close(code, variant)

    def _metadata(self) -> dict[str, Any]:
        frame = SAMPLE_WIDTH * self.dg.channels
        return {"type": "Metadata", "transaction_key": "deprecated", "request_id": self.rid,
                "sha256": self.sha.hexdigest(), "created": self.created,
                "duration": round(self.audio_bytes / frame / self.dg.sample_rate, 3),
                "channels": self.dg.channels, "models": [MODEL_UUID],
                "model_info": {MODEL_UUID: MODEL_INFO}}

    async def _read_all(self) -> None:
        outcome = await self._read()
        if not self.input_over.done():
            self.input_over.set_result(outcome)

    async def _read(self) -> Outcome:
        ws = self.ws
        while True:
            msg = await ws.receive()
            if msg.type is WSMsgType.BINARY:
                failure = await self._audio(msg.data)
            elif msg.type is WSMsgType.TEXT:
                failure = await self._control(msg.data)
            elif msg.type is WSMsgType.ERROR and ws.close_code == WSCloseCode.MESSAGE_TOO_BIG:
                return Failure("too_large", "frame larger than the hard cap")
            else:
                return Ending.CLIENT_GONE
            if failure is not None:
                return failure

    async def _audio(self, data: bytes) -> Failure | None:
        if self.closing or not data:
            return None  # Deepgram ignores audio after CloseStream
        channels = self.dg.channels
        width = SAMPLE_WIDTH if self.format is None else 1
        if len(data) % (width * channels):
            return Failure("bad_request", f"a frame of {len(data)} bytes is not whole "
                           f"{self.dg.encoding} samples of {channels} channel(s) "
                           f"({width * channels} bytes each): check encoding and channels")
        if len(data) > self.settings.max_frame_bytes * channels:
            return Failure("too_large", f"frame of {len(data)} bytes is over max_frame_bytes "
                           f"({self.settings.max_frame_bytes}) per channel")
        self.sha.update(data)
        pcm = data if self.format is None else self.format.to_pcm(data)
        self.audio_bytes += len(pcm)
        if channels == 1:
            return await self.relays[0].audio(pcm)
        samples = np.frombuffer(pcm, dtype="<i2").reshape(-1, channels)
        if not self.dg.multichannel:
            mixed = samples.mean(axis=1).round().astype("<i2")
            return await self.relays[0].audio(mixed.tobytes())
        for relay in self.relays:
            failure = await relay.audio(np.ascontiguousarray(samples[:, relay.index]).tobytes())
            if failure is not None:
                return failure
        return None

    async def _control(self, data: str) -> Failure | None:
        try:
            message = json.loads(data)
        except (ValueError, RecursionError):
            message = None
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "KeepAlive":
            self.keepalive_at = time.monotonic()
            for relay in self.relays:
                relay.touch()
        elif kind == "Finalize":
            for relay in self.relays:
                if not relay.ended:
                    await relay.commit()
        elif kind == "CloseStream":
            self.closing = True
            for relay in self.relays:
                await relay.end_audio()
        elif kind == "Configure":
            await self.send({"type": "ConfigureFailure", "request_id": self.rid,
                             "code": "CONFIGURE_KEYTERMS_NOT_SUPPORTED",
                             "description": "lanegate takes keyterms at connect time only "
                             "(keyterm query parameters)"})
        else:
            await self.send({"type": "Error", "variant": "SchemaError",
                             "description": "text frames are control messages: "
                             '{"type": "KeepAlive"}, {"type": "Finalize"} or '
                             '{"type": "CloseStream"}; audio goes in binary frames',
                             "message": data[:QUOTE_CHARS], "request_id": self.rid})
        return None


# --- handlers ---------------------------------------------------------------------------


async def listen(request: web.Request) -> web.StreamResponse:
    """``GET /v1/listen``: check the key and the query, upgrade, run a ``DeepgramSession``."""
    settings = request.app[SETTINGS]
    rid = request_id(uuid.uuid4().hex)
    if not web.WebSocketResponse().can_prepare(request).ok:
        raise http_error(426, "UPGRADE_REQUIRED", "GET /v1/listen is Deepgram's live API: "
                         "open a WebSocket (or POST the audio for a prerecorded result)",
                         rid, {"Upgrade": "websocket"})
    check_key(request, rid)
    dg = params_or_400(request, rid, live=True)
    ws = web.WebSocketResponse(
        protocols=(TOKEN_PROTOCOL,), autoclose=False,
        max_msg_size=settings.max_frame_bytes * FRAME_HARD_CAP * dg.channels)
    await ws.prepare(request)
    return await run_socket(request, DeepgramSession(request, ws, dg, rid))


def setup_deepgram(app: web.Application) -> None:
    """Register ``/v1/listen`` (after ``setup_stream``: its sessions drain with those)."""
    app.router.add_get(PATH, listen)
    app.router.add_post(PATH, transcribe)
