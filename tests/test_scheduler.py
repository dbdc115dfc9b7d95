"""The realtime lane scheduler: assertions on the plans it makes, not on wall time."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import read_pcm
from hypothesis import given
from hypothesis import strategies as st

from engines.base import CostPrior
from engines.simulated import SimulatedEngine
from lanegate.settings import Settings
from lanes.cost import CostModel
from lanes.scheduler import (
    Candidate,
    OldestPendingFirstQueue,
    StepLimits,
    plan_step,
)
from lanes.session import VAD_STEP_SAMPLES, RealtimeSession
from lanes.steploop import step_limits
from vad import VadSettings

RATE = 16000
CHUNK = 200 * RATE // 1000
BUDGET = StepLimits(max_chunk_samples=CHUNK, budget_s=0.050)


def model(rate: float = 0.1, fixed: float = 0.003, per_seq: float = 0.0005) -> CostModel:
    return CostModel.from_prior(CostPrior(rate, fixed, per_seq), alpha=0.2)


def test_plan_caps_chunks_and_stops_at_the_budget() -> None:
    cands = [Candidate(f"s{i}", RATE, float(i)) for i in range(10)]  # 1 s pending each
    plan = plan_step(cands, OldestPendingFirstQueue(), model(), BUDGET)
    assert plan.estimated_s <= BUDGET.budget_s + 1e-9
    assert all(c.samples <= CHUNK for c in plan.chunks)
    assert [c.session_id for c in plan.chunks] == ["s0", "s1", "s2"][: len(plan.chunks)]
    # 3 ms + 3 x 0.5 ms + 0.1 s/s x audio: two full chunks, then the 55 ms of audio left
    assert [c.samples for c in plan.chunks] == [CHUNK, CHUNK, 5 * 160]


def test_plan_always_holds_one_chunk() -> None:
    expensive = model(rate=10.0, fixed=0.2)  # one frame alone is over the budget
    plan = plan_step([Candidate("a", 4000, 0.0)], OldestPendingFirstQueue(), expensive, BUDGET)
    assert [(c.session_id, c.samples) for c in plan.chunks] == [("a", CHUNK)]
    assert not plan_step([Candidate("a", 0, 0.0)], OldestPendingFirstQueue(), model(), BUDGET)


def test_nocap_plan_takes_everything() -> None:
    cands = [Candidate("dump", 10 * RATE, 0.0), Candidate("live", 1600, 1.0)]
    limits = StepLimits(max_chunk_samples=CHUNK, budget_s=0.05, capped=False)
    plan = plan_step(cands, OldestPendingFirstQueue(), model(), limits)
    assert {c.session_id: c.samples for c in plan.chunks} == {"dump": 10 * RATE, "live": 1600}
    assert plan.estimated_s > limits.budget_s
    assert not step_limits(Settings(chunk_cap=False), "realtime").capped
    assert not step_limits(Settings(), "mixed").capped
    assert step_limits(Settings(), "realtime").capped


def test_queues_order_oldest_pending_first() -> None:
    cands = [Candidate("dump", 10 * RATE, 0.0), Candidate("live", 1600, 5.0),
             Candidate("live2", 1600, 4.0)]
    plan = plan_step(cands, OldestPendingFirstQueue(), model(rate=0.2), BUDGET)
    assert [c.session_id for c in plan.chunks] == ["dump", "live2", "live"][: len(plan.chunks)]


def test_cost_model_learns_from_measured_steps() -> None:
    cost = model(rate=0.25, fixed=0.001, per_seq=0.0)
    for _ in range(40):
        cost.observe(measured_s=0.001 + 0.5 * 0.2, audio_s=0.2, seqs=2)
    assert cost.s_per_audio_s == pytest.approx(0.5, rel=0.01)
    cost.observe(measured_s=5.0, audio_s=0.001, seqs=1)  # too little audio to learn from
    assert cost.s_per_audio_s == pytest.approx(0.5, rel=0.01)
    assert cost.spread > 1.0, "the prior was far off: recent steps ran over their estimate"
    for _ in range(64):  # a window of accurate estimates later, no margin is left
        cost.observe(measured_s=0.001 + 0.5 * 0.2, audio_s=0.2, seqs=2)
    assert cost.spread == pytest.approx(1.0, abs=0.01)
    assert cost.estimate_s(1.0, 2) == pytest.approx(0.501, rel=0.01)


def sessions_engine() -> SimulatedEngine:
    # An expensive modelled GPU: 100 ms of one stream costs 10.5 ms.
    settings = Settings(engine="simulated", sim_step_fixed_ms=3.0, sim_prefill_frame_ms=1.0,
                        sim_decode_seq_ms=0.5)
    return SimulatedEngine(settings, slots=8)


def test_cost_model_plans_against_the_tail_of_a_machine_whose_speed_varies() -> None:
    rng = random.Random(7)
    true_rate = 0.2
    cost = model(rate=true_rate, fixed=0.0, per_seq=0.0)
    over = 0
    for i in range(400):
        audio_s = cost.affordable_audio_s(0.050, 1)
        slowdown = 1.6 if rng.random() < 0.2 else 1.0  # one step in five runs slow
        measured = true_rate * audio_s * slowdown
        if i >= 100:
            over += measured > 0.050
        cost.observe(measured, audio_s, 1)
    assert cost.spread > 1.2
    assert over <= 0.05 * 300, f"{over} of 300 steps over the budget"


def test_tiny_steps_with_unmodelled_overhead_leave_the_spread_alone() -> None:
    cost = model(rate=0.0004, fixed=0.0, per_seq=0.0)  # a nearly free engine
    for _ in range(100):
        cost.observe(measured_s=0.0003, audio_s=0.1, seqs=1)  # 0.04 ms modelled, 0.3 ms real
        cost.observe(measured_s=0.010, audio_s=25.0, seqs=250)
    assert cost.spread < 1.5


def new_session(engine: SimulatedEngine, name: str) -> RealtimeSession:
    return RealtimeSession(name, RATE, engine.open_stream(), VadSettings(), 25 * RATE)


def test_a_10s_dump_never_breaks_the_budget_or_the_others_beat(
    speech: Callable[..., Path],
) -> None:
    engine = sessions_engine()
    cost = CostModel.from_prior(engine.cost_prior(), alpha=0.2)
    limits = step_limits(Settings(), "realtime")
    live_pcm, _ = read_pcm(speech("the weather is nice today and the children play outside"))
    dump_pcm, _ = read_pcm(speech("please call me back tomorrow morning about the meeting "
                                  "we will meet at the station at ten and then go home"))
    dump_pcm = (dump_pcm * 3)[: 10 * RATE * 2]
    live = [new_session(engine, f"live{i}") for i in range(3)]
    dump = new_session(engine, "dump")
    frame = 1600 * 2  # 100 ms
    dump_steps = 0
    for tick in range(120):
        now = tick * 0.1  # the live streams send 100 ms every 100 ms
        for i, session in enumerate(live):
            offset = (tick * frame + i * 4000) % (len(live_pcm) - frame)
            session.receive(live_pcm[offset : offset + frame], now)
        if tick == 5:
            dump.receive(dump_pcm, now)  # 10 s in one frame
        sessions = {s.session_id: s for s in [*live, dump]}
        for s in sessions.values():  # what the step loop does before planning
            s.analyse(VAD_STEP_SAMPLES)
            s.settle()
        cands = [s.candidate() for s in sessions.values()]
        plan = plan_step(cands, OldestPendingFirstQueue(), cost, limits)
        planned = {c.session_id for c in plan.chunks}
        assert plan.estimated_s <= limits.budget_s + 1e-9, tick
        assert all(c.samples <= limits.max_chunk_samples for c in plan.chunks)
        waiting = {c.session_id for c in cands if c.pending_samples and c.session_id != "dump"}
        assert waiting <= planned, (tick, waiting - planned)
        dump_steps += "dump" in planned
        work = [(sessions[c.session_id].stream, sessions[c.session_id].take(c.samples))
                for c in plan.chunks]
        hyps = engine.step(work)
        for c, hyp in zip(plan.chunks, hyps, strict=True):
            sessions[c.session_id].after_chunk(hyp, 0.0)
        if dump.cursor >= dump.buffered_end and tick > 5:
            break
    assert dump.cursor == dump.buffered_end == 10 * RATE, "the dump was digested"
    assert dump_steps >= 10 * RATE // CHUNK, "over many steps, never in one"


def drive(session: RealtimeSession, engine: SimulatedEngine, pcm: bytes,
          frame_bytes: int = 3200) -> tuple[list[dict[str, object]], int]:
    """Feed ``pcm`` frame by frame, decoding everything decodable after each frame
    (uncapped, so the cursor runs ahead of late VAD decisions); then end the session.
    Returns the events and the largest buffer seen (bytes)."""
    events: list[dict[str, object]] = []
    biggest = 0

    def decode_all() -> None:
        while True:
            session.analyse(VAD_STEP_SAMPLES)
            events.extend(session.settle())
            pending = session.candidate().pending_samples
            if not pending and not session.analysis_pending:
                return
            if pending:
                hyp = engine.step([(session.stream, session.take(pending))])[0]
                events.extend(session.after_chunk(hyp, 0.0))

    for off in range(0, len(pcm), frame_bytes):
        session.receive(pcm[off : off + frame_bytes], 0.0)
        decode_all()
        biggest = max(biggest, len(session._buf))
    session.end(0.0)
    decode_all()
    return events, biggest


def test_max_window_cut_behind_the_cursor_rewinds_it(speech: Callable[..., Path]) -> None:
    engine = SimulatedEngine(Settings(engine="simulated", sim_step_fixed_ms=0.0,
                                      sim_prefill_frame_ms=0.0, sim_decode_seq_ms=0.0), slots=1)
    vad = VadSettings(max_window_s=2.0, soft_cut_search_s=0.5, endpoint_silence_ms=1500)
    session = RealtimeSession("w", RATE, engine.open_stream(), vad, 25 * RATE)
    pcm, _ = read_pcm(speech("please call me back tomorrow morning about the meeting "
                             "and bring the large pizza with cheese to the station"))
    events, _ = drive(session, engine, pcm)
    finals = [e for e in events if e["type"] == "final"]
    cuts = [f for f in finals if f["cut"] == "max_window"]
    assert len(cuts) >= 2
    assert [f["segment"] for f in finals] == list(range(len(finals)))
    for f in finals:
        assert isinstance(f["end_ms"], int)
        assert isinstance(f["start_ms"], int)
        assert f["end_ms"] - f["start_ms"] <= 2000
        words = f["words"]
        assert isinstance(words, list)
        assert all(w["end"] <= f["end_ms"] / 1000 + 0.02 for w in words), f
    for a, b in itertools.pairwise(finals):
        if a["cut"] == "max_window":
            assert b["start_ms"] == a["end_ms"], "a soft cut loses no audio"
    assert session.finished
    assert session.cursor <= session.buffered_end


def test_session_memory_stays_bounded(speech: Callable[..., Path]) -> None:
    engine = SimulatedEngine(Settings(engine="simulated", sim_step_fixed_ms=0.0,
                                      sim_prefill_frame_ms=0.0, sim_decode_seq_ms=0.0), slots=1)
    vad = VadSettings(max_window_s=5.0)
    session = RealtimeSession("m", RATE, engine.open_stream(), vad, 5 * RATE)
    talk, _ = read_pcm(speech("thank you very much for your help"))
    pcm = (talk + bytes(2 * RATE)) * 20 + bytes(60 * RATE * 2)  # ~2 min, then 1 min of silence
    events, biggest = drive(session, engine, pcm)
    assert len([e for e in events if e["type"] == "final"]) >= 20
    assert biggest <= (5 + 2) * RATE * 2, "buffer bounded by the window, not the session"
    assert session._origin >= len(pcm) // 2 - 10 * RATE, "a decoder fed silence restarts"


def test_a_burst_ages_at_real_time_pace(speech: Callable[..., Path]) -> None:
    engine = sessions_engine()
    burst = new_session(engine, "burst")
    live = new_session(engine, "live")
    pcm, _ = read_pcm(speech("thank you very much for your help"))
    burst.receive(pcm, now=100.0)  # all of it at once
    assert burst.candidate().oldest_pending_at == 100.0
    # the VAD looks at a burst a slice at a time; unseen audio is not decodable yet
    assert burst.analysis_pending
    assert burst.candidate().pending_samples == RATE
    burst.analyse(len(pcm))
    assert not burst.analysis_pending
    burst.take(RATE)
    assert burst.candidate().oldest_pending_at == pytest.approx(101.0)
    live.receive(pcm[:3200], now=100.5)
    order = OldestPendingFirstQueue().order([burst.candidate(), live.candidate()], CHUNK)
    assert [c.session_id for c in order] == ["live", "burst"], "a burst ahead of real time waits"
    live.receive(pcm[3200:6400], now=102.0)
    live.take(800)
    assert live.candidate().oldest_pending_at == pytest.approx(100.55)
    live.take(800)
    assert live.candidate().oldest_pending_at == pytest.approx(102.0)


@given(
    pending=st.lists(st.tuples(st.integers(0, 20 * RATE), st.floats(0, 100)), max_size=40),
    rate=st.floats(0.001, 2.0), fixed=st.floats(0.0, 0.06), per_seq=st.floats(0.0, 0.005),
    capped=st.booleans(),
)
def test_plan_properties(pending: list[tuple[int, float]], rate: float, fixed: float,
                         per_seq: float, capped: bool) -> None:
    cands = [Candidate(f"s{i}", n, at) for i, (n, at) in enumerate(pending)]
    limits = StepLimits(max_chunk_samples=CHUNK, budget_s=0.05, capped=capped)
    plan = plan_step(cands, OldestPendingFirstQueue(), model(rate, fixed, per_seq), limits)
    waiting = {c.session_id: c.pending_samples for c in cands if c.pending_samples}
    taken = {c.session_id: c.samples for c in plan.chunks}
    assert bool(plan) == bool(waiting), "progress whenever audio waits"
    assert len(taken) == len(plan.chunks), "a session appears once"
    assert all(0 < taken[s] <= waiting[s] for s in taken)
    if not capped:
        assert taken == waiting
        return
    assert all(n <= CHUNK for n in taken.values())
    if len(plan.chunks) > 1:
        assert plan.estimated_s <= limits.budget_s + 1e-9
