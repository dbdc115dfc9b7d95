"""bench.floor: the bare server that scenario 5 sets the gateway against speaks enough of
/v1/stream for the load generator, at the event rate it documents."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio
from aiohttp import web

from bench.floor import FINAL_EVERY_FRAMES, PARTIAL_EVERY_FRAMES, make_app
from bench.load import BYTES_PER_MS, StreamResult, StreamSpec, run_live
from bench.measure import run_load
from bench.stack import cpu_list
from lanegate.supervisor import free_port


@pytest_asyncio.fixture
async def floor_url() -> AsyncIterator[str]:
    runner = web.AppRunner(make_app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"ws://127.0.0.1:{port}/v1/stream"
    await runner.cleanup()


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


def test_cpu_lists_read_as_taskset_writes_them() -> None:
    assert cpu_list("0") == [0]
    assert cpu_list("0-2") == [0, 1, 2]
    assert cpu_list("3,0-1") == [0, 1, 3]


async def test_run_load_places_its_processes_on_the_planned_cpus(floor_url: str,
                                                                 tmp_path: Path) -> None:
    """Scenarios 1-3 pin the load to the realtime CPU; ``run_load`` checks each load
    process's affinity against the plan and refuses a window whose load ran elsewhere."""
    pcm = tmp_path / "speech.pcm"
    pcm.write_bytes(bytes(BYTES_PER_MS * 100 * 10))
    spec = StreamSpec(kind="live", url=floor_url, pcm_path=str(pcm), duration_s=1.0)
    results, _ = await run_load([spec], tmp_path, "pinned", timeout_s=60, cpus="0")
    assert [r["error"] for r in results] == [""]
    assert results[0]["frames_sent"] == 11  # the audio and `end`
