"""Load generator: live WebSocket streams at real-time pace, and buffered-audio dumpers.

Run as a process of its own so that the clients' event loop is not the
orchestrator's: ``python -m bench.load SPEC.json OUT.json``. The spec lists
streams; every stream starts at ``t0`` (wall clock, shared by all load
processes) plus its ``start_s``. Latency is measured on this process's
monotonic clock: arrival of an event minus the send time of the frame that
holds the event's ``audio_end_ms``.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.wsclient import OP_TEXT, StreamSocket, WebSocketError, connect
from lanegate.loops import run

RATE = 16000
BYTES_PER_MS = RATE * 2 // 1000
DIGEST_SLACK_MS = 1500


@dataclass
class StreamSpec:
    kind: str  # "live": real-time pace; "dump": one session, whole buffers in one frame
    url: str  # full ws:// URL (public /v1/stream, or a worker's internal session URL)
    pcm_path: str  # raw PCM s16le mono 16 kHz
    start_s: float = 0.0  # delay after t0
    duration_s: float = 30.0  # live: seconds of audio to send; dump: no new dump after this
    pcm_offset_s: float = 0.0  # where in the PCM file this stream starts (wraps around)
    frame_ms: int = 100
    dump_s: float = 10.0  # dump: seconds of audio per dump frame
    dump_every_s: float = 10.0  # dump: a dump this often
    first_dump_s: float = 3.0  # dump: the first dump, seconds after the session opens


@dataclass
class StreamResult:
    kind: str
    lane: str = ""
    error: str = ""
    partial_ms: list[float] = field(default_factory=list)
    partial_at_s: list[float] = field(default_factory=list)  # arrival, seconds after t0
    first_partial_ms: list[float] = field(default_factory=list)
    final_ms: list[float] = field(default_factory=list)
    final_words: int = 0
    final_text: list[str] = field(default_factory=list)  # each final's text, in order
    finals_without_audio_end: int = 0
    audio_s_sent: float = 0.0
    dump_done_s: list[float] = field(default_factory=list)  # dump sent -> its text caught up
    frames_sent: int = 0  # WebSocket messages this client sent (audio and control)
    events_received: int = 0  # messages it received (the first, `ready`, included)


class Session:
    """One WebSocket session: frames sent with their times, events timed on arrival."""

    def __init__(self, result: StreamResult, t0: float) -> None:
        self.ws: StreamSocket | None = None
        self.result = result
        self.t0 = t0
        self.frame_end_ms: list[int] = []
        self.frame_sent: list[float] = []
        self.sent_ms = 0
        self.first_sent: float | None = None
        self.got_first = False
        self.done = asyncio.Event()
        self.digest_targets: list[tuple[int, float]] = []  # (audio_end_ms, sent) of dumps
        # the first message: `ready` from the gateway, `accepted` from a worker
        self.first: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

    async def send(self, pcm: bytes) -> None:
        now = time.perf_counter()
        self.sent_ms += len(pcm) // BYTES_PER_MS
        self.frame_end_ms.append(self.sent_ms)
        self.frame_sent.append(now)
        if self.first_sent is None:
            self.first_sent = now
        assert self.ws is not None
        self.result.frames_sent += 1
        await self.ws.send_bytes(pcm)
        self.result.audio_s_sent += len(pcm) / (RATE * 2)

    def sent_time(self, audio_end_ms: int) -> float | None:
        i = bisect.bisect_left(self.frame_end_ms, audio_end_ms)
        return self.frame_sent[i] if i < len(self.frame_sent) else None

    def on_event(self, msg: dict[str, Any], now: float) -> None:
        kind = msg.get("type")
        if kind == "partial":  # a final's audio_end_ms is where the VAD decided, not decoded
            self._digested(int(msg.get("audio_end_ms", -1)), now)
        elif kind == "final":
            self._digested(int(msg.get("end_ms", -1)), now)
        if kind == "partial":
            self._on_partial(msg, now)
        elif kind == "final":
            self._on_final(msg, now)
        elif kind == "error":
            self.result.error = self.result.error or str(msg.get("code", "error"))
        elif kind == "done":
            self.done.set()

    def _digested(self, decoded_ms: int, now: float) -> None:
        """A dump counts as digested once text reaches within DIGEST_SLACK_MS of its end
        (its last words may be followed by a pause that produces no event)."""
        while self.digest_targets and \
                decoded_ms >= self.digest_targets[0][0] - DIGEST_SLACK_MS:
            _, sent = self.digest_targets.pop(0)
            self.result.dump_done_s.append(now - sent)

    def _on_partial(self, msg: dict[str, Any], now: float) -> None:
        sent = self.sent_time(int(msg.get("audio_end_ms", -1)))
        if sent is not None:
            self.result.partial_ms.append((now - sent) * 1000)
            self.result.partial_at_s.append(now - self.t0)
        if not self.got_first and str(msg.get("text", "")).strip() and self.first_sent:
            self.got_first = True
            self.result.first_partial_ms.append((now - self.first_sent) * 1000)

    def _on_final(self, msg: dict[str, Any], now: float) -> None:
        self.result.final_words += len(str(msg.get("text", "")).split())
        self.result.final_text.append(str(msg.get("text", "")))
        if "audio_end_ms" not in msg:
            self.result.finals_without_audio_end += 1
            return
        sent = self.sent_time(int(msg["audio_end_ms"]))
        if sent is not None:
            self.result.final_ms.append((now - sent) * 1000)

    def on_message(self, opcode: int, payload: str | bytes) -> None:
        """Called by the connection for each message, as it arrives."""
        if opcode != OP_TEXT:
            return
        now = time.perf_counter()
        self.result.events_received += 1
        msg = json.loads(payload)
        if not self.first.done():
            self.first.set_result(msg)
        else:
            self.on_event(msg, now)

    async def watch_close(self) -> None:
        assert self.ws is not None
        await self.ws.closed_event.wait()
        self.done.set()


def session_url(url: str) -> str:
    if "{session_id}" in url:
        return url.replace("{session_id}", uuid.uuid4().hex)
    return url


async def open_session(spec: StreamSpec, result: StreamResult, t0: float) -> Session | None:
    """Connect and read the first message (`ready` from the gateway, `accepted` from a worker)."""
    session = Session(result, t0)
    try:
        ws = await connect(session_url(spec.url), session.on_message, timeout_s=30)
    except (OSError, WebSocketError, TimeoutError) as exc:
        result.error = f"connect: {type(exc).__name__}"
        return None
    session.ws = ws
    closed: asyncio.Future[Any] = asyncio.ensure_future(ws.closed_event.wait())
    waiters: set[asyncio.Future[Any]] = {session.first, closed}
    await asyncio.wait(waiters, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    closed.cancel()
    if not session.first.done():
        result.error = f"closed before ready ({ws.close_code})"
        await ws.close()
        return None
    msg = session.first.result()
    if msg.get("type") not in ("ready", "accepted"):
        result.error = str(msg.get("code", msg.get("type")))
        await ws.close()
        return None
    result.lane = str(msg.get("lane", ""))
    return session


async def finish(session: Session, wait_s: float = 60.0) -> None:
    assert session.ws is not None
    session.result.frames_sent += 1
    await session.ws.send_str(json.dumps({"type": "end"}))
    try:
        await asyncio.wait_for(session.done.wait(), wait_s)
    except TimeoutError:
        session.result.error = session.result.error or "no done"
    await session.ws.close()


def pcm_slice(pcm: bytes, offset_s: float, seconds: float) -> bytes:
    """``seconds`` of ``pcm`` from ``offset_s``, wrapping around."""
    start = int(offset_s * RATE) * 2 % len(pcm)
    need = int(seconds * RATE) * 2
    out = b""
    while len(out) < need:
        out += pcm[start:start + need - len(out)]
        start = 0
    return out


async def run_live(spec: StreamSpec, pcm: bytes,
                   t0: float, result: StreamResult) -> None:
    await asyncio.sleep(max(0.0, t0 + spec.start_s - time.perf_counter()))
    session = await open_session(spec, result, t0)
    if session is None:
        return
    reader = asyncio.create_task(session.watch_close())
    audio = pcm_slice(pcm, spec.pcm_offset_s, spec.duration_s)
    step = BYTES_PER_MS * spec.frame_ms
    start = time.perf_counter()
    for i, off in enumerate(range(0, len(audio), step)):
        await asyncio.sleep(max(0.0, start + i * spec.frame_ms / 1000 - time.perf_counter()))
        if session.done.is_set():
            break
        await session.send(audio[off:off + step])
    if session.done.is_set():
        result.error = result.error or "closed early"
    else:
        await finish(session)
    await reader


async def run_dumper(spec: StreamSpec, pcm: bytes,
                     t0: float, result: StreamResult) -> None:
    """One session (a client that keeps losing its network and catching up): every
    ``dump_every_s`` it sends ``dump_s`` of buffered audio in one frame."""
    await asyncio.sleep(max(0.0, t0 + spec.start_s - time.perf_counter()))
    session = await open_session(spec, result, t0)
    if session is None:
        return
    reader = asyncio.create_task(session.watch_close())
    first = t0 + spec.start_s + spec.first_dump_s
    last = t0 + spec.start_s + spec.duration_s
    k = 0
    while first + k * spec.dump_every_s < last and not session.done.is_set():
        await asyncio.sleep(max(0.0, first + k * spec.dump_every_s - time.perf_counter()))
        await session.send(pcm_slice(pcm, spec.pcm_offset_s + k * spec.dump_s, spec.dump_s))
        session.digest_targets.append((session.sent_ms, session.frame_sent[-1]))
        k += 1
    if not session.done.is_set():
        await finish(session, wait_s=max(60.0, spec.dump_s * 3))
    await reader


async def run_one(spec: StreamSpec, pcm: bytes, t0: float) -> StreamResult:
    """A stream whose connection breaks keeps what it measured and says why it broke."""
    result = StreamResult(kind=spec.kind)
    try:
        if spec.kind == "live":
            await run_live(spec, pcm, t0, result)
        else:
            await run_dumper(spec, pcm, t0, result)
    except (OSError, WebSocketError, RuntimeError, TimeoutError) as exc:
        result.error = result.error or f"{type(exc).__name__}: {exc}"[:120]
    return result


async def run_all(specs: list[StreamSpec], t0_wall: float,
                  cache: dict[str, bytes]) -> list[StreamResult]:
    t0 = time.perf_counter() + max(0.0, t0_wall - time.time())
    return list(await asyncio.gather(*(run_one(s, cache[s.pcm_path], t0) for s in specs)))


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    raw = json.loads(Path(spec_path).read_text())
    specs = [StreamSpec(**s) for s in raw["streams"]]
    cache = {path: Path(path).read_bytes() for path in {s.pcm_path for s in specs}}
    # uvloop: the clients must cost as little as the server they measure
    results = run(run_all(specs, float(raw["t0_wall"]), cache), "uvloop")
    Path(out_path).write_text(json.dumps({"cpu_s": time.process_time(),
                                          "cpus": sorted(os.sched_getaffinity(0)),
                                          "results": [asdict(r) for r in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
