"""What each protocol adapter adds over ``/v1/stream``, measured in the same stack one
right after the other: Deepgram's ``/v1/listen`` WebSocket, Wyoming on TCP and the
OpenAI Realtime API (``/v1/realtime?intent=transcription``).

Every session streams the same utterance at real-time pace in 100 ms frames, then
ends it the protocol's way (``/v1/stream``: ``end``; Deepgram: ``CloseStream``;
Wyoming: ``audio-stop``; Realtime: ``input_audio_buffer.commit`` with turn detection
off), and two figures are taken:

* **finalize latency**, every protocol: from that end to the utterance's final
  transcript (``final``; the last ``Results`` with ``is_final``; ``transcript``;
  ``conversation.item.input_audio_transcription.completed``);
* **partial latency**, where the protocol says which audio a partial covers
  (``/v1/stream``'s ``audio_end_ms``, Deepgram's interim ``start + duration``): its
  arrival minus the send of the frame that holds that audio's end, as
  ``bench.load`` times it. (Wyoming has no partials; Realtime's deltas carry no
  audio position.)

The added latency is a protocol's p99 minus ``/v1/stream``'s p99 in the same round.
The stack is scenario 5's (simulated workers whose steps cost nothing), so what is
left is the gateway's and the adapter's own time.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient

from bench.stats import summary

RATE = 16000
FRAME_MS = 100
FRAME_BYTES = RATE * 2 * FRAME_MS // 1000
PROTOCOLS = ("stream", "deepgram", "wyoming", "realtime")
#: a session that has not finalized this long after its end is counted as an error
FINAL_TIMEOUT_S = 30.0


@dataclass
class Session:
    """One session's timings (monotonic seconds)."""

    sent: list[float] = field(default_factory=list)  # send time of frame k (its end: k+1)
    partial_ms: list[float] = field(default_factory=list)
    finalize_ms: float | None = None
    error: str = ""

    def on_partial(self, audio_end_ms: float, now: float) -> None:
        """A partial covering audio up to ``audio_end_ms``: timed from the frame that
        holds that end."""
        k = max(0, int((audio_end_ms - 1e-6) // FRAME_MS))
        if k < len(self.sent):
            self.partial_ms.append((now - self.sent[k]) * 1000)


async def paced(pcm: bytes, session: Session,
                send: Callable[[bytes], Awaitable[None]]) -> float:
    """Send ``pcm`` in 100 ms frames at real-time pace; the time the last was sent."""
    t0 = time.monotonic()
    for k, off in enumerate(range(0, len(pcm), FRAME_BYTES)):
        await asyncio.sleep(max(0.0, t0 + k * FRAME_MS / 1000 - time.monotonic()))
        session.sent.append(time.monotonic())
        await send(pcm[off:off + FRAME_BYTES])
    return time.monotonic()


async def _ws_session(url: str, pcm: bytes, first: dict[str, Any] | None,
                      end: dict[str, Any], on_text: Callable[[dict[str, Any], float, Session],
                                                             str | None]) -> Session:
    """A WebSocket session: ``first`` sent after connecting, audio, ``end``; ``on_text``
    reads each event and returns "final" (the finalize figure is this event, unless a
    later one is also "final") or "stop"."""
    s = Session()
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
        if first is not None:
            await ws.send_str(json.dumps(first))
        ended: list[float] = []

        async def reader() -> None:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                now = time.monotonic()
                what = on_text(json.loads(msg.data), now, s)
                if what == "final" and ended:
                    s.finalize_ms = (now - ended[0]) * 1000
                elif what == "stop" or s.error:
                    return

        task = asyncio.create_task(reader())
        try:
            ended.append(await paced(pcm, s, ws.send_bytes))
            await ws.send_str(json.dumps(end))
            await asyncio.wait_for(task, FINAL_TIMEOUT_S)
        except (TimeoutError, aiohttp.ClientError) as exc:
            s.error = s.error or type(exc).__name__
        finally:
            task.cancel()
    return s


def _stream_event(msg: dict[str, Any], now: float, s: Session) -> str | None:
    kind = msg.get("type")
    if kind == "partial" and msg.get("text"):
        s.on_partial(float(msg["audio_end_ms"]), now)
    elif kind == "final":
        return "final"
    elif kind == "done":
        return "stop"
    elif kind == "error":
        s.error = str(msg.get("code"))
    return None


def _deepgram_event(msg: dict[str, Any], now: float, s: Session) -> str | None:
    kind = msg.get("type")
    if kind == "Results":
        if msg.get("is_final"):
            return "final"
        if msg["channel"]["alternatives"][0].get("transcript"):
            s.on_partial((float(msg["start"]) + float(msg["duration"])) * 1000, now)
    elif kind == "Metadata":
        return "stop"
    elif kind == "Error":
        s.error = str(msg.get("err_code") or msg.get("description"))
    return None


def _realtime_event(msg: dict[str, Any], now: float, s: Session) -> str | None:
    kind = msg.get("type")
    if kind == "conversation.item.input_audio_transcription.completed":
        return "final" if s.finalize_ms is None else None
    if kind == "error":
        s.error = str(msg.get("error", {}).get("code"))
    return None


async def stream(base: str, pcm: bytes) -> Session:
    url = base.replace("http", "ws", 1) + "/v1/stream?sample_rate=16000&language=en"
    return await _ws_session(url, pcm, None, {"type": "end"}, _stream_event)


async def deepgram(base: str, pcm: bytes) -> Session:
    url = (base.replace("http", "ws", 1) + "/v1/listen?encoding=linear16&sample_rate=16000"
           "&channels=1&interim_results=true&language=en")
    return await _ws_session(url, pcm, None, {"type": "CloseStream"}, _deepgram_event)


async def realtime(base: str, pcm: bytes) -> Session:
    """Turn detection off, so the commit ends the utterance; the session stays open
    after its ``completed`` (the first one after the commit is the figure)."""
    url = base.replace("http", "ws", 1) + "/v1/realtime?intent=transcription"
    update = {"type": "session.update", "session": {
        "type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": RATE}, "turn_detection": None,
            "transcription": {"language": "en"}}}}}
    s = Session()
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
        await ws.send_str(json.dumps(update))
        committed: list[float] = []
        done = asyncio.Event()

        async def reader() -> None:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                now = time.monotonic()
                if _realtime_event(json.loads(msg.data), now, s) == "final" and committed:
                    s.finalize_ms = (now - committed[0]) * 1000
                    done.set()
                    return
                if s.error:
                    done.set()
                    return

        async def append(chunk: bytes) -> None:
            await ws.send_str(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(chunk).decode()}))

        task = asyncio.create_task(reader())
        try:
            await paced(pcm, s, append)
            committed.append(time.monotonic())
            await ws.send_str(json.dumps({"type": "input_audio_buffer.commit"}))
            await asyncio.wait_for(done.wait(), FINAL_TIMEOUT_S)
        except (TimeoutError, aiohttp.ClientError) as exc:
            s.error = s.error or type(exc).__name__
        finally:
            task.cancel()
    return s


async def wyoming(host: str, port: int, pcm: bytes) -> Session:
    """Home Assistant's own client (the ``wyoming`` package) on TCP."""
    s = Session()
    client = AsyncTcpClient(host, port)
    await client.connect()
    try:
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=RATE, width=2, channels=1).event())

        async def chunk(data: bytes) -> None:
            await client.write_event(AudioChunk(rate=RATE, width=2, channels=1,
                                                audio=data).event())

        await paced(pcm, s, chunk)
        ended = time.monotonic()
        await client.write_event(AudioStop().event())

        async def transcript() -> None:
            while True:
                event = await client.read_event()
                if event is None:
                    s.error = "closed"
                    return
                if Transcript.is_type(event.type):
                    s.finalize_ms = (time.monotonic() - ended) * 1000
                    return
                if event.type == "error":
                    s.error = str(event.data.get("code"))
                    return

        await asyncio.wait_for(transcript(), FINAL_TIMEOUT_S)
    except (TimeoutError, OSError) as exc:
        s.error = s.error or type(exc).__name__
    finally:
        await client.disconnect()
    return s


async def sessions(protocol: str, base: str, wyoming_port: int, pcm: bytes,
                   concurrent: int, repeats: int) -> list[Session]:
    """``concurrent`` sessions at a time (staggered over one frame), ``repeats`` times."""
    async def one(k: int) -> Session:
        await asyncio.sleep(FRAME_MS / 1000 * k / max(concurrent, 1))
        if protocol == "wyoming":
            return await wyoming("127.0.0.1", wyoming_port, pcm)
        run = {"stream": stream, "deepgram": deepgram, "realtime": realtime}[protocol]
        return await run(base, pcm)

    out: list[Session] = []
    for _ in range(repeats):
        out += await asyncio.gather(*(one(k) for k in range(concurrent)))
    return out


def figures(got: list[Session]) -> dict[str, Any]:
    errors: dict[str, int] = {}
    for s in got:
        if s.error or s.finalize_ms is None:
            key = s.error or "no final"
            errors[key] = errors.get(key, 0) + 1
    return {"sessions": len(got),
            "finalize_ms": summary([s.finalize_ms for s in got if s.finalize_ms is not None]),
            "partial_ms": summary([v for s in got for v in s.partial_ms]),
            "errors": errors}


async def measure(base: str, wyoming_port: int, pcm: bytes, *, concurrent: int,
                  repeats: int) -> dict[str, Any]:
    """Every protocol in turn, ``/v1/stream`` first, on the same utterance."""
    out: dict[str, Any] = {}
    for protocol in PROTOCOLS:
        out[protocol] = figures(await sessions(protocol, base, wyoming_port, pcm,
                                               concurrent, repeats))
        print(f"  [protocols/{protocol}] finalize {out[protocol]['finalize_ms']} "
              f"partial p99 {out[protocol]['partial_ms']['p99']} "
              f"errors {out[protocol]['errors']}", flush=True)
    return out


def added(res: dict[str, Any], protocol: str, figure: str) -> float | None:
    """A protocol's p99 of ``figure`` minus ``/v1/stream``'s, from one round."""
    ours = (res.get(protocol) or {}).get(figure, {}).get("p99")
    base = (res.get("stream") or {}).get(figure, {}).get("p99")
    return None if ours is None or base is None else float(ours) - float(base)
