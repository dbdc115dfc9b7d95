"""Live streams to WhisperLive, in its own protocol, timed like ``bench.load`` times ours.

    python -m bench.peer_load SPEC.json OUT.json

A stream sends its options, waits for ``SERVER_READY``, then float32 PCM in 100 ms
frames at real-time pace. WhisperLive answers with the last completed segments and
the current partial after each transcription pass. A *forward-moving* partial is a
message whose latest segment end passed every earlier one; its lag is its arrival
minus the send time of the frame that holds that end (lanegate's partial latency,
measured the same way on the same clock). After the audio the stream waits
``tail_s`` for the last segments (WhisperLive drops what is not completed when the
client ends), then sends ``END_OF_AUDIO``. Its text: the completed segments, plus the
partial last seen after them.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.wsclient import OP_TEXT, WebSocketError, connect
from lanegate.loops import run

RATE = 16000
FRAME_MS = 100


@dataclass
class PeerSpec:
    url: str  # ws://host:port/
    pcm_path: str  # s16le mono 16 kHz
    model: str
    start_s: float = 0.0
    tail_s: float = 15.0  # wait after the audio for the last segments to complete


@dataclass
class PeerResult:
    error: str = ""
    lag_ms: list[float] = field(default_factory=list)
    lag_at_s: list[float] = field(default_factory=list)
    messages: int = 0
    completed: dict[str, str] = field(default_factory=dict)  # start -> text
    partial: str = ""
    partial_start: float = -1.0
    audio_s_sent: float = 0.0
    text: str = ""


class PeerStream:
    def __init__(self, result: PeerResult, t0: float) -> None:
        self.result = result
        self.t0 = t0
        self.ready: asyncio.Future[dict[str, Any]] = \
            asyncio.get_running_loop().create_future()
        self.frame_end_s: list[float] = []
        self.frame_sent: list[float] = []
        self.covered_s = 0.0
        self.last_message = time.perf_counter()

    def on_message(self, opcode: int, payload: str | bytes) -> None:
        if opcode != OP_TEXT:
            return
        now = time.perf_counter()
        msg = json.loads(payload)
        if not self.ready.done():
            if msg.get("message") == "SERVER_READY" or msg.get("status"):
                self.ready.set_result(msg)
            return
        segments = msg.get("segments")
        if not segments:
            return
        self.last_message = now
        self.result.messages += 1
        for seg in segments:
            if seg.get("completed"):
                self.result.completed[str(seg["start"])] = str(seg.get("text", ""))
        last = segments[-1]
        if not last.get("completed"):
            self.result.partial = str(last.get("text", ""))
            self.result.partial_start = float(last["start"])
        end = max(float(s["end"]) for s in segments)
        if end > self.covered_s:
            self.covered_s = end
            i = bisect.bisect_left(self.frame_end_s, end)
            if i < len(self.frame_sent):
                self.result.lag_ms.append((now - self.frame_sent[i]) * 1000)
                self.result.lag_at_s.append(now - self.t0)

    def text(self) -> str:
        starts = sorted(self.result.completed, key=float)
        parts = [self.result.completed[s] for s in starts]
        last = float(starts[-1]) if starts else -1.0
        if self.result.partial and self.result.partial_start > last:
            parts.append(self.result.partial)
        return " ".join(p.strip() for p in parts)


async def run_stream(spec: PeerSpec, pcm: bytes, t0: float) -> PeerResult:
    result = PeerResult()
    await asyncio.sleep(max(0.0, t0 + spec.start_s - time.perf_counter()))
    stream = PeerStream(result, t0)
    try:
        ws = await connect(spec.url, stream.on_message, timeout_s=30)
    except (OSError, WebSocketError, TimeoutError) as exc:
        result.error = f"connect: {type(exc).__name__}"
        return result
    await ws.send_str(json.dumps({
        "uid": uuid.uuid4().hex, "language": "en", "task": "transcribe", "model": spec.model,
        "use_vad": True, "send_last_n_segments": 10, "no_speech_thresh": 0.45,
        "clip_audio": False, "same_output_threshold": 10, "audio_format": "float32"}))
    try:
        ready = await asyncio.wait_for(stream.ready, 60)
    except TimeoutError:
        result.error = "no SERVER_READY"
        await ws.close()
        return result
    if ready.get("message") != "SERVER_READY":
        result.error = f"{ready.get('status')}: {ready.get('message')}"
        await ws.close()
        return result
    audio = (np.frombuffer(pcm, dtype=np.int16).astype(np.float32) / 32768.0).tobytes()
    step = RATE * 4 * FRAME_MS // 1000
    start = time.perf_counter()
    for i, off in enumerate(range(0, len(audio), step)):
        await asyncio.sleep(max(0.0, start + i * FRAME_MS / 1000 - time.perf_counter()))
        if ws.closed:
            result.error = "closed early"
            break
        chunk = audio[off:off + step]
        stream.frame_end_s.append((off + len(chunk)) / (RATE * 4))
        stream.frame_sent.append(time.perf_counter())
        await ws.send_bytes(chunk)
        result.audio_s_sent += len(chunk) / (RATE * 4)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(ws.closed_event.wait(), spec.tail_s)
    if not ws.closed:
        await ws.send_bytes(b"END_OF_AUDIO")
        await ws.close()
    result.text = stream.text()
    return result


async def run_all(specs: list[PeerSpec], t0_wall: float,
                  cache: dict[str, bytes]) -> list[PeerResult]:
    t0 = time.perf_counter() + max(0.0, t0_wall - time.time())

    async def one(spec: PeerSpec) -> PeerResult:
        try:
            return await run_stream(spec, cache[spec.pcm_path], t0)
        except (OSError, WebSocketError, RuntimeError) as exc:
            return PeerResult(error=f"{type(exc).__name__}: {exc}"[:120])

    return list(await asyncio.gather(*(one(s) for s in specs)))


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    raw = json.loads(Path(spec_path).read_text())
    specs = [PeerSpec(**s) for s in raw["streams"]]
    cache = {p: Path(p).read_bytes() for p in {s.pcm_path for s in specs}}
    results = run(run_all(specs, float(raw["t0_wall"]), cache), "uvloop")
    Path(out_path).write_text(json.dumps({"results": [asdict(r) for r in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
