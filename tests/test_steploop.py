"""The step loop: sessions are served through it, and idle sessions cost it nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from conftest import read_pcm

from engines.simulated import SimulatedEngine
from lanegate.settings import Settings
from lanes.scheduler import Candidate
from lanes.session import RealtimeSession
from lanes.steploop import Close, SessionHandle, StepLoop
from vad import VadSettings

RATE = 16000
FRAME = 1600 * 2  # 100 ms


class CountingSession(RealtimeSession):
    """A session that counts how often the loop looks at it."""

    visits = 0

    def candidate(self) -> Candidate:
        self.visits += 1
        return super().candidate()


def cheap_engine(slots: int) -> SimulatedEngine:
    settings = Settings(engine="simulated", sim_step_fixed_ms=0.0, sim_prefill_frame_ms=0.0,
                        sim_decode_seq_ms=0.0)
    return SimulatedEngine(settings, slots=slots)


async def drain(handle: SessionHandle) -> list[dict[str, object]]:
    events: list[dict[str, object]] = []
    while True:
        item = await asyncio.wait_for(handle.outbox.get(), 10)
        if isinstance(item, Close):
            return events
        events.append(item)


async def test_a_talking_session_is_served_and_idle_ones_are_not_visited(
    speech: Callable[..., Path],
) -> None:
    pcm, _ = read_pcm(speech("the weather is nice today and the children play outside"))
    engine = cheap_engine(slots=201)
    loop = StepLoop(engine, Settings(engine="simulated"), lane="realtime", worker_id="t")
    idle = [CountingSession(f"idle{i}", RATE, engine.open_stream(), VadSettings(), 25 * RATE)
            for i in range(200)]
    for session in idle:
        loop.add(session)
    stop = asyncio.Event()
    runner = asyncio.create_task(loop.run(stop))
    await asyncio.sleep(0.05)  # the new sessions are settled once
    looked_at = sum(s.visits for s in idle)

    talker = loop.add(RealtimeSession("talker", RATE, engine.open_stream(), VadSettings(),
                                      25 * RATE))
    for off in range(0, len(pcm) - FRAME, FRAME):
        talker.session.receive(pcm[off:off + FRAME], asyncio.get_running_loop().time())
        loop.touch(talker)
        await asyncio.sleep(0.005)
    talker.session.end(asyncio.get_running_loop().time())
    loop.touch(talker)
    events = await drain(talker)
    stop.set()
    loop.wake()
    await runner

    kinds = [e["type"] for e in events]
    assert "partial" in kinds
    assert kinds[-1] == "done"
    assert loop.steps > 10
    assert sum(s.visits for s in idle) == looked_at, "idle sessions were planned again"
