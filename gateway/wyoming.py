"""Wyoming, Home Assistant's speech protocol, on TCP (``wyoming_port``): a thin adapter
that makes each ``audio-start`` ... ``audio-stop`` of a connection one realtime-lane
session through the same ``Relay`` as ``/v1/stream`` (README, "Use it from Home
Assistant"). (Over 400 lines: the framing, the connection, its sessions and the server
share one protocol's state.)

Framing, as the ``wyoming`` package writes it: a JSON header line ``{"type", "data"?,
"data_length"?, "payload_length"?, "version"?}``, then ``data_length`` bytes of a JSON
object merged into ``data``, then ``payload_length`` bytes of payload. Each part is
bounded before it is read: the header line and the data by ``wyoming_max_event_bytes``,
the payload by ``max_frame_bytes``. A header that breaks these rules (not JSON, a
length that is not a whole number, over its bound) loses the framing: the client gets
an ``error`` event and the connection is closed. An audio chunk whose payload is not
whole 16-bit samples gets an ``error`` and ends its transcription; the connection goes on.

Events in: ``describe`` (answered with ``info``: one ASR program, its model and
languages, ``supports_transcript_streaming``), ``transcribe`` (``language`` for the next
audio), ``audio-start`` (16-bit mono PCM at 8-48 kHz), ``audio-chunk``, ``audio-stop``,
``ping`` (``pong``); others are ignored, as Wyoming servers do. Out, for each
transcription: ``transcript-start``, a ``transcript-chunk`` per final as the realtime
lane decodes it (while the audio still flows), then ``transcript`` (the whole text) and
``transcript-stop``; or an ``error`` (``text``, ``code``: the codes of ``/v1/stream``).

Access (``lanegate.wyoming_access``): served only while auth is off, so every caller is
anonymous and its sessions count against its address (``max_sessions_per_key``,
``max_key_share``), as a keyless stream's do. The limits of a stream hold: idle,
``max_session_s``, ``max_session_wall_s``, ``min_realtime_ratio``. A connection holds a
decoder slot only between ``audio-start`` and its transcript; at most
``wyoming_max_connections`` are open, and one with no event for ``idle_timeout_s``
outside a transcription is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from importlib.metadata import version as _version
from pathlib import PurePath
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from gateway.auth import address_subject, lease_member
from gateway.intake import UploadError
from gateway.params import parse_language, parse_sample_rate
from gateway.relay import Ending, Failure, Outcome, Relay
from gateway.state import LEASES, SETTINGS, WYOMING
from gateway.workers_client import NoWorkers, Overloaded, WorkerSession, open_worker_session
from lanegate import metrics
from lanegate.constants import SAMPLE_WIDTH
from lanegate.logs import get_logger
from lanegate.settings import Settings
from lanegate.wyoming_access import closed_reason

log = get_logger("gateway.wyoming")

PROTOCOL = "wyoming"
#: the ``version`` field of what the gateway writes (the Wyoming release it speaks)
VERSION = "1.10.0"
#: the ASR program's version in ``info``: lanegate's own
PROGRAM_VERSION = _version("lanegate")
#: how long a connection whose framing failed drains the client's bytes before closing
LINGER_S = 1.0
#: Whisper's languages (its tokenizer's); the ``info`` event lists them
WHISPER_LANGUAGES = (
    "en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr", "pl", "ca", "nl", "ar", "sv",
    "it", "id", "hi", "fi", "vi", "he", "uk", "el", "ms", "cs", "ro", "da", "hu", "ta", "no",
    "th", "ur", "hr", "bg", "lt", "la", "mi", "ml", "cy", "sk", "te", "fa", "lv", "bn", "sr",
    "az", "sl", "kn", "et", "mk", "br", "eu", "is", "hy", "ne", "mn", "bs", "kk", "sq", "sw",
    "gl", "mr", "pa", "si", "km", "sn", "yo", "so", "af", "oc", "ka", "be", "tg", "sd", "gu",
    "am", "yi", "lo", "uz", "fo", "ht", "ps", "tk", "nn", "mt", "sa", "lb", "my", "bo", "tl",
    "mg", "as", "tt", "haw", "ln", "ha", "ba", "jw", "su", "yue",
)


@dataclass
class WyomingEvent:
    type: str
    data: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""


class FramingError(Exception):
    """The connection's framing cannot be trusted any more: ``error``, then close."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def encode_event(event: dict[str, Any], payload: bytes = b"") -> bytes:
    """An event as the ``wyoming`` package frames it (the data after the header line)."""
    header: dict[str, Any] = {"type": event["type"], "version": VERSION}
    data = event.get("data") or {}
    body = json.dumps(data, ensure_ascii=False).encode() if data else b""
    if body:
        header["data_length"] = len(body)
    if payload:
        header["payload_length"] = len(payload)
    return json.dumps(header, ensure_ascii=False).encode() + b"\n" + body + payload


def _length(header: dict[str, Any], key: str, bound: int, what: str) -> int:
    value = header.get(key)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FramingError("bad_request", f"{key} must be a whole number of bytes, not "
                           f"{value!r}")
    if value > bound:
        raise FramingError("too_large", f"{key} {value} is over {what} ({bound} bytes)")
    return value


async def read_event(reader: asyncio.StreamReader, settings: Settings) -> WyomingEvent | None:
    """The next event; None at the end of the stream. Raises ``FramingError``."""
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise FramingError("bad_request", "the connection ended inside an event") from None
        return None
    except asyncio.LimitOverrunError:
        raise FramingError("too_large", "event header line over wyoming_max_event_bytes "
                           f"({settings.wyoming_max_event_bytes} bytes)") from None
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):
        raise FramingError("bad_request", "an event header is one line of JSON") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise FramingError("bad_request", 'an event header is a JSON object with a "type"')
    data_length = _length(header, "data_length", settings.wyoming_max_event_bytes,
                          "wyoming_max_event_bytes")
    payload_length = _length(header, "payload_length", settings.max_frame_bytes,
                             "max_frame_bytes")
    data = header.get("data") or {}
    try:
        if data_length:
            extra = json.loads(await reader.readexactly(data_length))
            if not isinstance(extra, dict) or not isinstance(data, dict):
                raise FramingError("bad_request", "event data is a JSON object")
            data = {**data, **extra}
        payload = await reader.readexactly(payload_length) if payload_length else b""
    except asyncio.IncompleteReadError:
        raise FramingError("bad_request", "the connection ended inside an event") from None
    except (ValueError, RecursionError):
        raise FramingError("bad_request", "event data is a JSON object") from None
    if not isinstance(data, dict):
        raise FramingError("bad_request", "event data is a JSON object")
    return WyomingEvent(header["type"], data, payload)


def info_event(settings: Settings) -> dict[str, Any]:
    """``info``: one ASR program serving the configured engine's model."""
    whisper = settings.engine == "whisper"
    languages = list(WHISPER_LANGUAGES) if whisper else ["en"]
    # a bundled name (``base``) or a model directory's name
    model = PurePath(settings.whisper_model).name if whisper else str(settings.engine)
    attribution = {"name": "lanegate", "url": "https://pypi.org/project/lanegate/"}
    return {"type": "info", "data": {"asr": [{
        "name": "lanegate", "description": "lanegate's realtime lane", "installed": True,
        "attribution": attribution, "version": PROGRAM_VERSION,
        "supports_transcript_streaming": True,
        "models": [{"name": model, "description": f"{settings.engine} {model}",
                    "installed": True, "attribution": attribution, "version": None,
                    "languages": languages}],
    }]}}


class Connection:
    """One Wyoming TCP connection: its events in order, and the transcription they ask
    for one after the other."""

    def __init__(self, app: web.Application, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.app = app
        self.settings: Settings = app[SETTINGS]
        self.reader = reader
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.remote = str(peer[0]) if isinstance(peer, tuple) and peer else None
        # one event read ahead; a FramingError or None (end) is the last item
        self.inbox: asyncio.Queue[WyomingEvent | FramingError | None] = asyncio.Queue(1)
        self.session: Session | None = None
        self.shutting_down = False
        self.language = ""  # from ``transcribe``, for the next audio only
        self.discarding = False  # dropping audio until audio-stop (its session failed)
        self.broken = False  # its framing failed: nothing more is read
        self.finished = asyncio.Event()
        self.log = log.bind(remote=self.remote)

    async def send(self, event: dict[str, Any]) -> bool:
        if self.writer.is_closing():
            return False
        try:
            self.writer.write(encode_event(event))
            await self.writer.drain()
        except (ConnectionError, RuntimeError):
            return False
        return True

    async def error(self, code: str, message: str) -> bool:
        return await self.send({"type": "error", "data": {"text": message, "code": code}})

    async def run(self) -> None:
        reading = asyncio.create_task(self._read_loop(), name="wyoming-read")
        try:
            await self._serve()
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            if self.broken:
                await self._linger()
            self.writer.close()
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.writer.wait_closed()
            self.finished.set()

    async def _linger(self) -> None:
        """After a framing error: end our side, then read (and drop) what the client still
        sends for a moment, so that closing with unread bytes does not reset the
        connection before the client has read its ``error``."""
        with contextlib.suppress(ConnectionError, RuntimeError, OSError, TimeoutError):
            if self.writer.can_write_eof():
                self.writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                while await self.reader.read(65536):
                    pass

    async def _read_loop(self) -> None:
        while True:
            try:
                event = await read_event(self.reader, self.settings)
            except FramingError as exc:
                await self.inbox.put(exc)
                return
            except (ConnectionError, OSError):
                event = None
            await self.inbox.put(event)
            if event is None:
                return

    async def next_item(self) -> WyomingEvent | FramingError | None:
        item = await self.inbox.get()
        if isinstance(item, FramingError):
            self.broken = True
        return item

    async def _serve(self) -> None:
        while not self.shutting_down:
            try:
                item = await asyncio.wait_for(self.next_item(), self.settings.idle_timeout_s)
            except TimeoutError:
                await self.error("timeout", f"no event for {self.settings.idle_timeout_s:g} s "
                                 "(idle_timeout_s)")
                return
            if item is None:
                return
            if isinstance(item, FramingError):
                metrics.REJECTIONS.labels(lane="realtime", reason=item.code).inc()
                await self.error(item.code, item.message)
                return
            if not await self.handle(item):
                return

    async def handle(self, event: WyomingEvent) -> bool:
        """One event outside a transcription; False once the connection must close."""
        kind = event.type
        if kind == "describe":
            return await self.send(info_event(self.settings))
        if kind == "ping":
            return await self.send({"type": "pong", "data": {"text": event.data.get("text")}})
        if kind == "transcribe":
            try:
                self.language = parse_language(_text(event.data.get("language")))
            except UploadError as exc:
                self.discarding = True
                return await self.error("bad_request", exc.message)
            self.discarding = False
            return True
        if kind == "audio-start":
            return await self._transcribe(event)
        if kind == "audio-chunk":
            if self.discarding:
                return True
            self.discarding = True
            return await self.error("bad_request", "audio-chunk before audio-start")
        if kind == "audio-stop":
            if self.discarding:
                self.discarding = False
                return True
            return await self.error("bad_request", "audio-stop before audio-start")
        return True

    async def _transcribe(self, start: WyomingEvent) -> bool:
        language, self.language = self.language, ""
        fmt = audio_format(start.data)
        if isinstance(fmt, Failure):
            self.discarding = True
            metrics.REJECTIONS.labels(lane="realtime", reason=fmt.code).inc()
            return await self.error(fmt.code, fmt.message)
        session = Session(self, fmt, language)
        self.session = session
        try:
            outcome = await session.run()
        finally:
            self.session = None
        if self.broken or self.shutting_down or outcome is Ending.CLIENT_GONE:
            return False
        # refused or failed: the rest of its audio, up to audio-stop, is dropped
        self.discarding = outcome is not Ending.DONE
        return True

    async def shutdown(self) -> None:
        """The gateway is stopping: a transcription ends its audio and gets its last
        finals; then the connection closes."""
        self.shutting_down = True
        if self.session is None:
            self.writer.close()  # the reader sees the end; the connection closes
            return
        self.session.shutting_down = True
        if self.session.relay is not None:
            await self.session.relay.end_audio()


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def audio_format(data: dict[str, Any]) -> int | Failure:
    """The sample rate of an ``audio-start`` (or a chunk) lanegate takes, or why not."""
    width, channels, rate = data.get("width"), data.get("channels"), data.get("rate")
    if width != SAMPLE_WIDTH or channels != 1:
        return Failure("bad_request", f"lanegate takes 16-bit mono PCM (width {SAMPLE_WIDTH}, "
                       f"channels 1), not width {width!r}, channels {channels!r}")
    try:
        return parse_sample_rate(str(rate) if isinstance(rate, int) else "x")
    except UploadError as exc:
        return Failure("bad_request", exc.message)


class Session:
    """One transcription (``audio-start`` to its transcript): the relay's client."""

    def __init__(self, connection: Connection, sample_rate: int, language: str) -> None:
        self.connection = connection
        self.app = connection.app
        self.settings = connection.settings
        self.sample_rate = sample_rate
        self.language = language
        self.session_id = uuid.uuid4().hex
        self.lease_id = lease_member(self.app, self.session_id)
        self.subject = address_subject(connection.remote)
        self.leased = False
        self.relay: WyomingRelay | None = None
        self.shutting_down = connection.shutting_down
        self.started = time.monotonic()
        self.log = connection.log.bind(session_id=self.session_id, lane="realtime",
                                       protocol=PROTOCOL)

    async def send(self, event: dict[str, Any]) -> bool:
        return await self.connection.send(event)

    def error_event(self, code: str, message: str) -> dict[str, Any]:
        return {"type": "error", "data": {"text": message, "code": code}}

    async def close(self, code: int, message: str = "") -> None:
        """The session is over (not the connection): its lease goes at once."""
        if self.leased:
            self.leased = False
            with contextlib.suppress(RedisError):
                await self.app[LEASES].release(self.subject, self.lease_id)

    async def reject(self, failure: Failure) -> None:
        metrics.REJECTIONS.labels(lane="realtime", reason=failure.code).inc()
        metrics.PROTOCOL_SESSIONS.labels(lane="realtime", protocol=PROTOCOL,
                                         outcome=failure.code).inc()
        self.log.info("stream_rejected", code=failure.code, reason=failure.message)
        await self.send(self.error_event(failure.code, failure.message))

    def _worker(self, exclude: frozenset[str] = frozenset()) -> Awaitable[WorkerSession]:
        return open_worker_session(self.app, session_id=self.session_id,
                                   sample_rate=self.sample_rate, language=self.language,
                                   exclude=exclude)

    async def run(self) -> Outcome | None:
        """Admit, relay, and say how it ended (None: refused before it began)."""
        try:
            limit = await self.app[LEASES].admit(self.subject, self.lease_id)
        except RedisError:
            await self.reject(Failure("overloaded", "service unavailable; try again later"))
            return None
        if limit is not None:
            await self.reject(Failure("overloaded", "this client address already holds its "
                                      f"limit of {limit} realtime sessions"))
            return None
        self.leased = True
        try:
            try:
                worker = await self._worker()
            except (NoWorkers, Overloaded) as exc:
                await self.reject(Failure("overloaded", f"{exc}; try again later"))
                return None
            except RedisError:
                await self.reject(Failure("overloaded", "service unavailable; try again later"))
                return None
            relay = WyomingRelay(self, worker, session_id=self.session_id,
                                 sample_rate=self.sample_rate, settings=self.settings,
                                 started=self.started, reopen=self._worker)
            self.relay = relay
            self.log.info("stream_start", sample_rate=self.sample_rate,
                          language=self.language, protocol=PROTOCOL)
            try:
                outcome = await relay.run()
            finally:
                await relay.worker.close()
            ended = outcome.code if isinstance(outcome, Failure) else outcome.value
            metrics.PROTOCOL_SESSIONS.labels(lane=relay.lane, protocol=PROTOCOL,
                                             outcome=ended).inc()
            relay.log.info("stream_end", outcome=ended, protocol=PROTOCOL,
                           audio_s=round(relay.timeline.audio_ms / 1000.0, 3),
                           duration_s=round(time.monotonic() - self.started, 3))
            return outcome
        finally:
            await self.close(0)


class WyomingRelay(Relay):
    """The relay with Wyoming's events: audio chunks in, transcript events out."""

    client: Session

    def __init__(self, client: Session, worker: WorkerSession, **kwargs: Any) -> None:
        super().__init__(client, worker, **kwargs)
        self.client = client
        self.texts: list[str] = []
        self.detected = ""  # the language the finals report
        self.started_transcript = False

    async def _pump_client(self) -> Outcome:
        connection = self.client.connection
        while True:
            if self.ended:  # after audio-stop: only the client leaving matters
                await asyncio.get_running_loop().create_future()  # until cancelled
            item = await connection.next_item()
            if item is None:
                return Ending.CLIENT_GONE
            if isinstance(item, FramingError):
                return Failure(item.code, item.message)
            failure = await self._on_event(item)
            if failure is not None:
                return failure

    async def _on_event(self, event: WyomingEvent) -> Failure | None:
        kind = event.type
        if kind == "audio-chunk":
            rate = audio_format(event.data)
            if rate != self.client.sample_rate:
                return Failure("bad_request", "an audio-chunk's format differs from its "
                               "audio-start's")
            if len(event.payload) % SAMPLE_WIDTH:
                return Failure("bad_request", f"an audio-chunk of {len(event.payload)} bytes "
                               "is not whole 16-bit samples")
            return await self._on_audio(event.payload)
        if kind == "audio-stop":
            await self.end_audio()
            return None
        if kind == "describe":
            await self.client.send(info_event(self.settings))
        elif kind == "ping":
            await self.client.send({"type": "pong", "data": {"text": event.data.get("text")}})
        elif kind in ("transcribe", "audio-start"):
            return Failure("bad_request", f"{kind} during a transcription (send audio-stop "
                           "first)")
        return None

    async def forward(self, event: dict[str, Any]) -> bool:
        if event["type"] != "final":
            if event["type"] == "partial":
                self._observe("partial", event)
            return True
        self._observe("final", event)
        text = str(event.get("text") or "").strip()
        language = str(event.get("language") or "")
        if language:
            self.detected = language
        if not text:
            return True
        if not await self._start():
            return False
        chunk = text if not self.texts else " " + text
        self.texts.append(text)
        return await self.client.send({"type": "transcript-chunk", "data": {"text": chunk}})

    async def _start(self) -> bool:
        if self.started_transcript:
            return True
        self.started_transcript = True
        data = {"language": self.language_out} if self.language_out else {}
        return await self.client.send({"type": "transcript-start", "data": data})

    @property
    def language_out(self) -> str:
        return self.client.language or self.detected

    async def conclude(self, outcome: Outcome) -> None:
        if outcome is Ending.DONE:
            if await self._start():
                data: dict[str, Any] = {"text": " ".join(self.texts)}
                if self.language_out:
                    data["language"] = self.language_out
                if await self.client.send({"type": "transcript", "data": data}):
                    await self.client.send({"type": "transcript-stop"})
            await self.client.close(0)
            return
        await super().conclude(outcome)  # the error event; the lease goes


# --- the server --------------------------------------------------------------------------


@dataclass
class WyomingServer:
    """The TCP server and its live connections (``app[WYOMING]``)."""

    server: asyncio.Server | None = None
    connections: set[Connection] = field(default_factory=set)


async def _accept(app: web.Application, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
    state = app[WYOMING]
    connection = Connection(app, reader, writer)
    if len(state.connections) >= app[SETTINGS].wyoming_max_connections:
        metrics.REJECTIONS.labels(lane="realtime", reason="overloaded").inc()
        await connection.error("overloaded", "the gateway holds its limit of "
                               f"{app[SETTINGS].wyoming_max_connections} Wyoming connections "
                               "(wyoming_max_connections)")
        writer.close()
        return
    state.connections.add(connection)
    try:
        await connection.run()
    except Exception:
        connection.log.exception("wyoming_internal_error")
        await connection.error("internal", "internal gateway error")
    finally:
        state.connections.discard(connection)


async def wyoming_ctx(app: web.Application) -> AsyncIterator[None]:
    """Serve Wyoming on ``host:wyoming_port`` while the app runs (when the access rule
    allows it); a port that cannot be bound is logged and the gateway serves on."""
    settings = app[SETTINGS]
    state = WyomingServer()
    app[WYOMING] = state
    closed = closed_reason(settings)
    if closed is not None:
        if settings.wyoming_port:
            log.warning("wyoming_off", reason=closed)
    else:
        try:
            state.server = await asyncio.start_server(
                lambda r, w: _accept(app, r, w), settings.host, settings.wyoming_port,
                limit=settings.wyoming_max_event_bytes)
        except OSError as exc:
            log.error("wyoming_unavailable", host=settings.host, port=settings.wyoming_port,
                      error=str(exc), message="Wyoming is not served; set another "
                      "--wyoming-port, or 0 to turn it off")
        else:
            log.info("wyoming_start", host=settings.host, port=settings.wyoming_port)
    yield
    await _drain(app)


async def _begin_drain(app: web.Application) -> None:
    """``on_shutdown``: stop accepting and end every transcription's audio at once (their
    last finals come while the streams drain); ``wyoming_ctx``'s exit waits for them."""
    state = app[WYOMING]
    if state.server is not None:
        state.server.close()
    for connection in list(state.connections):
        await connection.shutdown()


async def _drain(app: web.Application) -> None:
    state = app[WYOMING]
    connections = list(state.connections)
    for connection in connections:
        await connection.shutdown()
    waits = [asyncio.create_task(c.finished.wait()) for c in connections]
    if waits:
        await asyncio.wait(waits, timeout=app[SETTINGS].drain_timeout_s)
        for wait in waits:
            wait.cancel()
    for connection in list(state.connections):
        await connection.error("internal", "gateway shutting down; reconnect")
        connection.writer.close()


def setup_wyoming(app: web.Application) -> None:
    """Serve Wyoming with the app (after the links it relays through); call before
    ``setup_stream`` so that its transcriptions begin to drain with the streams."""
    app.cleanup_ctx.append(wyoming_ctx)
    app.on_shutdown.append(_begin_drain)
