"""bench.floor: the bare server that scenario 5 sets the gateway against speaks enough of
/v1/stream for the load generator, at the event rate it documents."""

from __future__ import annotations

import time

from bench.floor import FINAL_EVERY_FRAMES, PARTIAL_EVERY_FRAMES
from bench.load import BYTES_PER_MS, StreamResult, StreamSpec, run_live


async def test_a_load_stream_gets_ready_partials_finals_and_done(floor_url: str) -> None:
    frames = FINAL_EVERY_FRAMES  # 100 ms frames at real time: 5 s
    spec = StreamSpec(kind="live", url=floor_url, pcm_path="", duration_s=frames / 10)
    pcm = bytes(BYTES_PER_MS * 100 * frames)
    result = StreamResult(kind="live")
    started = time.perf_counter()
    await run_live(spec, pcm, started, result)
    assert result.error == ""
    assert result.lane == "floor"
    assert result.frames_sent == frames + 1  # the audio and `end`
    finals = frames // FINAL_EVERY_FRAMES
    partials = frames // PARTIAL_EVERY_FRAMES - finals
    assert len(result.final_text) == finals
    # ready, the events, done: 2.2 events per 10 frames, the gateway's rate
    assert result.events_received == 1 + partials + finals + 1
    assert len(result.partial_ms) == partials  # each maps back to the frame it ends

