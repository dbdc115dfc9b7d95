"""``lanegate stream FILE``: stream a WAV file to ``/v1/stream`` at real-time pace.

Sends 100 ms binary frames paced at real time x ``--speed`` (0: as fast as
possible), then ``{"type":"end"}``. Partials are printed in place on one line
(carriage return), finals on their own lines. Exit codes: 0 after ``done``;
1 on an ``error`` event or a connection problem; 2 for a file it cannot send.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import wave
from dataclasses import dataclass
from typing import Any, TextIO

import aiohttp
from yarl import URL

FRAME_MS = 100
EXIT_OK, EXIT_ERROR, EXIT_BAD_FILE = 0, 1, 2


class BadFile(ValueError):
    """The file is not a WAV this client can stream."""


@dataclass(frozen=True)
class Audio:
    pcm: bytes
    sample_rate: int

    @property
    def frame_bytes(self) -> int:
        return self.sample_rate * 2 * FRAME_MS // 1000


def read_wav(path: str) -> Audio:
    """PCM s16le mono samples of a WAV file; ``BadFile`` with the reason otherwise."""
    try:
        with wave.open(path, "rb") as wav:
            channels, width, rate = wav.getnchannels(), wav.getsampwidth(), wav.getframerate()
            pcm = wav.readframes(wav.getnframes())
    except FileNotFoundError:
        raise BadFile(f"{path}: no such file") from None
    except (wave.Error, EOFError) as exc:
        raise BadFile(f"{path}: not a PCM WAV file ({exc}); convert it with "
                      f"`sox {path} -c 1 -b 16 -e signed-integer out.wav`") from None
    if channels != 1 or width != 2:
        raise BadFile(f"{path}: needs PCM s16le mono, got {channels} channel(s) of "
                      f"{8 * width}-bit samples; convert it with "
                      f"`sox {path} -c 1 -b 16 -e signed-integer out.wav`")
    return Audio(pcm, rate)


def stream_url(base: str, sample_rate: int, language: str = "en") -> str:
    """``ws(s)://host/v1/stream?sample_rate=R`` from an http(s) or ws(s) base URL."""
    url = URL(base)
    scheme = {"http": "ws", "https": "wss"}.get(url.scheme, url.scheme)
    path = url.path.rstrip("/")
    if not path.endswith("/v1/stream"):
        path += "/v1/stream"
    return str(url.with_scheme(scheme).with_path(path).with_query(
        sample_rate=str(sample_rate), language=language))


class Printer:
    """Partials rewrite the current line; finals end it."""

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


async def receive_events(ws: aiohttp.ClientWebSocketResponse, printer: Printer) -> int:
    async for msg in ws:
        if msg.type is not aiohttp.WSMsgType.TEXT:
            continue
        event: dict[str, Any] = json.loads(msg.data)
        kind = event.get("type")
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
                      out: TextIO) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as http, http.ws_connect(
        stream_url(url, audio.sample_rate), headers=headers, heartbeat=30.0
    ) as ws:
        sender = asyncio.create_task(send_audio(ws, audio, speed))
        try:
            return await receive_events(ws, Printer(out))
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)


def main(args: argparse.Namespace) -> int:
    """``lanegate stream FILE [--url] [--api-key] [--speed]``."""
    try:
        audio = read_wav(str(args.file))
    except BadFile as exc:
        print(f"lanegate stream: {exc}", file=sys.stderr)
        return EXIT_BAD_FILE
    if args.speed < 0:
        print("lanegate stream: --speed must be >= 0", file=sys.stderr)
        return EXIT_BAD_FILE
    api_key = args.api_key or os.environ.get("LANEGATE_API_KEY") or None
    try:
        return asyncio.run(stream_file(audio, url=args.url, api_key=api_key,
                                       speed=args.speed, out=sys.stdout))
    except (aiohttp.ClientError, OSError) as exc:
        print(f"lanegate stream: cannot stream to {args.url}: {exc}", file=sys.stderr)
        return EXIT_ERROR
