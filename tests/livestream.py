"""A live-stream client for the failover tests: it records every event with its arrival
time, and checks what a user would check of a transcript that crossed a failover."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from phrases import recall

FRAME_MS = 100
SPEED = 2.0  # x real time
#: how long a test waits for one event before it fails (not a latency assertion)
EVENT_WAIT_S = 30.0
#: a final's words lie in its segment, give or take the VAD padding and overshoot
WORD_SLACK_MS = 700


@dataclass
class Seen:
    """What the client received, with the arrival time of each event."""

    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    close_code: int | None = None

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for _, e in self.events if e["type"] == kind]

    def longest_gap_after(self, when: float) -> float:
        """The longest time without a partial or final from ``when`` on: the blip."""
        times = [when] + [t for t, e in self.events
                          if t > when and e["type"] in ("partial", "final")]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


async def receive_all(ws: aiohttp.ClientWebSocketResponse, seen: Seen) -> None:
    while True:
        msg = await ws.receive(timeout=EVENT_WAIT_S)
        if msg.type is aiohttp.WSMsgType.TEXT:
            seen.events.append((time.monotonic(), json.loads(msg.data)))
        else:
            seen.close_code = ws.close_code
            return


async def send_speech(ws: aiohttp.ClientWebSocketResponse, pcm: bytes, rate: int,
                      speed: float = SPEED) -> None:
    """100 ms frames at ``speed`` x real time (0: as fast as the socket takes them)."""
    step = rate * 2 * FRAME_MS // 1000
    for offset in range(0, len(pcm), step):
        await ws.send_bytes(pcm[offset:offset + step])
        await asyncio.sleep(FRAME_MS / 1000 / speed if speed else 0)
    await ws.send_str('{"type":"end"}')


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + EVENT_WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)



def check_transcript(seen: Seen, sentences: Sequence[str], threshold: float) -> None:
    """What a client checks: it ended well, every final once, in order, with its words
    where its segment is, and partials that never go back."""
    kinds = [e["type"] for _, e in seen.events]
    assert "error" not in kinds, seen.events
    assert kinds[-1] == "done", seen.events
    assert seen.close_code == 1000
    finals = seen.of("final")
    assert [f["segment"] for f in finals] == list(range(len(finals))), finals
    for before, after in itertools.pairwise(finals):
        assert after["start_ms"] >= before["end_ms"], (before, after)
    for final in finals:
        for word in final["words"]:
            assert final["start_ms"] - WORD_SLACK_MS <= word["start"] * 1000 \
                <= word["end"] * 1000 <= final["end_ms"] + WORD_SLACK_MS, final
    done_finals = 0
    last_end = -1
    for _, event in seen.events:
        if event["type"] == "final":
            done_finals += 1
        elif event["type"] == "partial":
            assert event["segment"] == done_finals, seen.events
            assert event["audio_end_ms"] >= last_end, seen.events
            last_end = event["audio_end_ms"]
    text = " ".join(f["text"] for f in finals)
    for sentence in sentences:
        assert recall(sentence, text) >= threshold, (sentence, text)
