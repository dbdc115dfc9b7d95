"""``lanegate stream FILE``: stream an audio file to ``/v1/stream`` at real-time pace.

The file is decoded like an upload (any format PyAV reads: wav, flac, ogg, mp3,
m4a, ...; any rate and channel count, resampled to 16 kHz mono s16le by
``lanegate.audio``), then sent in 100 ms binary frames paced at real time x
``--speed`` (0: as fast as possible), then ``{"type":"end"}``.

On a terminal, partials are rewritten in place on one line (carriage return)
and finals get their own lines. Piped (stdout not a terminal), each final is one
line and partials are left out unless ``--partials`` asks for them, as lines of
their own prefixed ``(partial)``. Exit codes: 0 after ``done``; 1 on an
``error`` event or a connection problem; 2 for a file it cannot send or a bad
argument.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

import aiohttp
from yarl import URL

from lanegate.audio import AudioError, DecodedAudio, decode_to_pcm
from lanegate.constants import ENGINE_SAMPLE_RATE
from lanegate.gateway_url import BadURL, normalize_base_url
from lanegate.settings import Settings

FRAME_MS = 100
EXIT_OK, EXIT_ERROR, EXIT_BAD_FILE = 0, 1, 2
PARTIAL_PREFIX = "(partial) "


class BadFile(ValueError):
    """The file cannot be decoded into audio to stream."""


@dataclass(frozen=True)
class Audio:
    pcm: bytes
    sample_rate: int
    #: what the file was, e.g. ``wav pcm_f32le 44100 Hz, 2 ch``
    source: str = ""
    converted: bool = False

    @property
    def frame_bytes(self) -> int:
        return self.sample_rate * 2 * FRAME_MS // 1000


def _describe(decoded: DecodedAudio) -> str:
    return (f"{decoded.container} {decoded.codec} {decoded.source_rate} Hz, "
            f"{decoded.source_channels} ch")


def read_audio(path: str, max_seconds: float | None = None) -> Audio:
    """16 kHz mono s16le samples of any audio file; ``BadFile`` saying what it is otherwise.
    ``max_seconds``: the longest file decoded (default: the uploads' ``max_audio_seconds``;
    the gateway ends a stream at ``max_session_s``)."""
    if max_seconds is None:
        max_seconds = Settings.from_env().max_audio_seconds
    src = Path(path)
    if not src.is_file():
        raise BadFile(f"{path}: no such file" if not src.exists() else f"{path}: not a file")
    with tempfile.TemporaryDirectory(prefix="lanegate-stream-") as tmp:
        dest = Path(tmp) / "audio.pcm"
        try:
            decoded = decode_to_pcm(src, dest, max_seconds=max_seconds)
        except AudioError as exc:
            raise BadFile(f"{path}: {_what_is_wrong(src, exc)}") from None
        except OSError as exc:
            raise BadFile(f"{path}: cannot read it ({exc.strerror or exc})") from None
        converted = (decoded.codec, decoded.source_rate, decoded.source_channels) != (
            "pcm_s16le", ENGINE_SAMPLE_RATE, 1)
        return Audio(dest.read_bytes(), ENGINE_SAMPLE_RATE, _describe(decoded), converted)


def _what_is_wrong(src: Path, exc: AudioError) -> str:
    if src.stat().st_size == 0:
        return "the file is empty (0 bytes)"
    message = str(exc)
    if "no decodable audio samples" in message:
        return "holds no audio samples (an empty recording: 0 s)"
    return message


def stream_url(base: str, sample_rate: int, language: str = "en") -> str:
    """``ws(s)://host/v1/stream?sample_rate=R`` from an http(s) or ws(s) base URL."""
    url = URL(base)
    scheme = {"http": "ws", "https": "wss"}.get(url.scheme, url.scheme)
    path = url.path.rstrip("/")
    if not path.endswith("/v1/stream"):
        path += "/v1/stream"
    return str(url.with_scheme(scheme).with_path(path).with_query(
        sample_rate=str(sample_rate), language=language))


class Output(Protocol):
    def partial(self, text: str) -> None: ...

    def final(self, text: str) -> None: ...

    def clear(self) -> None: ...


class Printer:
    """On a terminal: partials rewrite the current line; finals end it."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.width = 0

    def partial(self, text: str) -> None:
        self.out.write("\r" + text.ljust(self.width))
        self.width = len(text)
        self.out.flush()

    def final(self, text: str) -> None:
        self.out.write("\r" + text.ljust(self.width) + "\n")
        self.width = 0
        self.out.flush()

    def clear(self) -> None:
        if self.width:
            self.out.write("\r" + " " * self.width + "\r")
            self.width = 0
            self.out.flush()


class LinePrinter:
    """Piped: one line per final; partials as ``(partial) ...`` lines when asked for."""

    def __init__(self, out: TextIO, *, partials: bool = False) -> None:
        self.out = out
        self.partials = partials

    def partial(self, text: str) -> None:
        if self.partials and text:
            self.out.write(PARTIAL_PREFIX + text + "\n")
            self.out.flush()

    def final(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def clear(self) -> None:
        pass


def output_for(out: TextIO, *, partials: bool) -> Output:
    isatty = getattr(out, "isatty", None)
    if isatty is not None and isatty():
        return Printer(out)
    return LinePrinter(out, partials=partials)


async def send_audio(ws: aiohttp.ClientWebSocketResponse, audio: Audio, speed: float) -> None:
    start = time.monotonic()
    step = audio.frame_bytes
    for offset in range(0, len(audio.pcm), step):
        if ws.closed:
            return
        await ws.send_bytes(audio.pcm[offset:offset + step])
        if speed > 0:
            due = start + (offset + step) / (audio.sample_rate * 2) / speed
            await asyncio.sleep(max(0.0, due - time.monotonic()))
    if not ws.closed:
        await ws.send_str('{"type":"end"}')


async def receive_events(ws: aiohttp.ClientWebSocketResponse, printer: Output) -> int:
    async for msg in ws:
        if msg.type is not aiohttp.WSMsgType.TEXT:
            continue
        try:
            event: Any = json.loads(msg.data)
        except ValueError:
            continue
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "partial":
            printer.partial(str(event.get("text", "")))
        elif kind == "final":
            printer.final(str(event.get("text", "")))
        elif kind == "error":
            printer.clear()
            print(f"lanegate stream: error {event.get('code')}: {event.get('message')}",
                  file=sys.stderr)
            return EXIT_ERROR
        elif kind == "done":
            printer.clear()
            return EXIT_OK
    printer.clear()
    print(f"lanegate stream: connection closed before done (code {ws.close_code})",
          file=sys.stderr)
    return EXIT_ERROR


async def stream_file(audio: Audio, *, url: str, api_key: str | None, speed: float,
                      out: TextIO, partials: bool = False) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientWSTimeout(ws_close=10.0)
    async with aiohttp.ClientSession() as http, http.ws_connect(
        stream_url(url, audio.sample_rate), headers=headers, heartbeat=30.0, timeout=timeout
    ) as ws:
        sender = asyncio.create_task(send_audio(ws, audio, speed))
        try:
            return await receive_events(ws, output_for(out, partials=partials))
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)


def _fail(message: str, code: int) -> int:
    print(f"lanegate stream: {message}", file=sys.stderr)
    return code


def main(args: argparse.Namespace) -> int:
    """``lanegate stream FILE [--url] [--api-key] [--speed] [--partials]``."""
    try:
        url = normalize_base_url(str(args.url))
    except BadURL as exc:
        return _fail(str(exc), EXIT_BAD_FILE)
    if args.speed < 0:
        return _fail("--speed must be >= 0", EXIT_BAD_FILE)
    try:
        audio = read_audio(str(args.file))
    except BadFile as exc:
        return _fail(str(exc), EXIT_BAD_FILE)
    if audio.converted:
        print(f"lanegate stream: {args.file} is {audio.source}; streaming it as "
              f"{audio.sample_rate} Hz mono 16-bit", file=sys.stderr)
    api_key = args.api_key or os.environ.get("LANEGATE_API_KEY") or None
    try:
        return asyncio.run(stream_file(audio, url=url, api_key=api_key, speed=args.speed,
                                       out=sys.stdout,
                                       partials=bool(getattr(args, "partials", False))))
    except aiohttp.WSServerHandshakeError as exc:
        hint = " (is this a lanegate gateway?)" if exc.status == 404 else ""
        return _fail(f"{url} refused the stream: HTTP {exc.status} {exc.message}{hint}",
                     EXIT_ERROR)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return _fail(f"cannot stream to {url}: {exc or type(exc).__name__}", EXIT_ERROR)
