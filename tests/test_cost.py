"""The step cost model of a re-decoding engine (Whisper) and the plans made with it
(pure: no engine, no clock)."""

from __future__ import annotations

import numpy as np
import pytest

from engines.base import CostPrior, StepProfile
from lanes.cost import CostModel, OnlineFit
from lanes.scheduler import Candidate, OldestPendingFirstQueue, StepLimits, plan_step

RATE = 16000
LIMITS = StepLimits(max_chunk_samples=3200, budget_s=1.0)


def whisper_prior(**changes: float) -> CostPrior:
    values = {"frame_s": 0.0003, "frame2_s": 1e-7, "per_seq_s": 0.05, "token_s": 0.02,
              "tokens_per_step": 6.0, "pad_frames": 100, **changes}
    return CostPrior(0.0, 0.005, redecodes=True, **values)  # type: ignore[arg-type]


def model(**changes: float) -> CostModel:
    return CostModel.from_prior(whisper_prior(**changes), alpha=0.2)


def test_the_estimate_is_a_polynomial_in_frames_plus_decoder_terms() -> None:
    cost = model()
    one = cost.redecode_estimate_s(1, 1000)
    assert one == pytest.approx(0.005 + 0.3 + 0.1 + 0.05 + 6 * 0.02)
    # two sequences padded to the same length cost two encodes, one token loop
    assert cost.redecode_estimate_s(2, 1000) == pytest.approx(0.005 + 0.8 + 0.1 + 0.12)
    assert cost.redecode_estimate_s(1, 3000) > 3 * (one - 0.005 - 0.17)  # super-linear


def test_online_fit_finds_the_true_coefficients() -> None:
    fit = OnlineFit(np.array([1.0, 1.0]), forget=0.95)
    rng = np.random.default_rng(7)
    for _ in range(200):
        x = rng.uniform(0.1, 3.0, size=2)
        fit.observe(x, float(np.array([0.4, 0.05]) @ x))
    assert fit.coef == pytest.approx([0.4, 0.05], abs=0.01)


def test_a_slower_machine_is_learned_from_the_engines_own_timings() -> None:
    cost = model()
    before = cost.redecode_estimate_s(2, 1500)
    for frames in (400, 900, 1500, 2600, 700, 1200) * 5:
        k = frames / 1000
        cost.observe_profile(1.0, StepProfile(2, frames, encode_s=2 * 3 * (0.3 * k + 0.1 * k * k),
                                              tokens=8, decode_s=2 * 0.05 * 3 + 8 * 0.02 * 3))
    assert cost.redecode is not None
    assert cost.redecode.tokens_per_step == pytest.approx(8.0, abs=0.1)
    assert cost.redecode.encoder_s(2, 1500) == pytest.approx(
        3 * 2 * (0.3 * 1.5 + 0.1 * 2.25), rel=0.05)
    assert cost.redecode.decoder_s(2, 8) == pytest.approx(3 * (0.1 + 0.16), rel=0.05)
    assert cost.redecode_estimate_s(2, 1500) > 2.5 * before


def test_a_redecode_plan_takes_whole_pending_audio_and_stops_at_the_budget() -> None:
    cost = model()
    cands = [Candidate(f"s{i}", 8000, float(i), context_samples=2 * RATE) for i in range(6)]
    plan = plan_step(cands, OldestPendingFirstQueue(), cost, LIMITS)
    assert all(c.samples == 8000 for c in plan.chunks), "no chunk cap for a re-decode"
    assert [c.session_id for c in plan.chunks] == [f"s{i}" for i in range(len(plan.chunks))]
    assert 1 <= len(plan.chunks) < 6
    assert plan.estimated_s <= LIMITS.budget_s
    frames = (2 * RATE + 8000) // 160 + 100
    assert plan.estimated_s == pytest.approx(cost.redecode_estimate_s(len(plan.chunks), frames))


def test_a_long_segment_is_one_step_and_keeps_the_others_out() -> None:
    """The cap cannot split one segment's encoder pass; it keeps it from taking
    others along, and it is served when its audio is the oldest."""
    cost = model()
    dump = Candidate("dump", 20 * RATE, 0.0)
    live = Candidate("live", 3200, 1.0, context_samples=RATE)
    plan = plan_step([dump, live], OldestPendingFirstQueue(), cost, LIMITS)
    assert [(c.session_id, c.samples) for c in plan.chunks] == [("dump", 20 * RATE)]
    assert plan.estimated_s > LIMITS.budget_s  # a step always holds one session
    plan = plan_step([live], OldestPendingFirstQueue(), cost, LIMITS)
    assert [(c.session_id, c.samples) for c in plan.chunks] == [("live", 3200)]


def test_a_decode_for_good_and_a_partial_never_share_a_step() -> None:
    """A Whisper step lasts as long as its longest generation: a partial beside another
    session's final or sealed piece would wait for it. The oldest session's kind makes
    the step; sessions of the other kind wait for a step of their own."""
    cost = model(frame_s=0.00001, frame2_s=0.0, token_s=0.001)  # all four fit the budget
    final = Candidate("final", 3200, 0.0, context_samples=8 * RATE, for_good=True)
    live = [Candidate(f"live{i}", 3200, 1.0 + i, context_samples=2 * RATE) for i in range(2)]
    piece = Candidate("piece", 3200, 4.0, context_samples=8 * RATE, for_good=True)
    queue = OldestPendingFirstQueue()
    plan = plan_step([final, *live, piece], queue, cost, LIMITS)
    assert [c.session_id for c in plan.chunks] == ["final", "piece"]
    plan = plan_step([*live, piece], queue, cost, LIMITS)
    assert [c.session_id for c in plan.chunks] == ["live0", "live1"]
    frames = (2 * RATE + 3200) // 160 + 100  # the partials' step is not padded to a piece
    assert plan.estimated_s == pytest.approx(cost.redecode_estimate_s(2, frames))
    plan = plan_step([piece], queue, cost, LIMITS)
    assert [c.session_id for c in plan.chunks] == ["piece"]
