"""The realtime lane's step cost model, learned online from measured steps.

Estimated step time = (fixed + per_seq * streams + s_per_audio_s * audio seconds)
x spread. Only the per-audio-second rate is learned (an EWMA of what each measured
step implies); the fixed and per-stream terms are the engine's prior. So the mean
holds on any hardware: a slower machine raises the rate after a few steps.

The spread keeps the tail under the budget too: it is the 95th percentile of
measured / estimated over recent steps estimated at 5 ms or more (at least 1,
at most 3). On a machine whose speed
varies from one step to the next (a shared or throttled VM), an estimate that is
right on average puts many steps over the budget; planning against the
estimate's recent tail does not.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.engines.base import CostPrior

# Steps with less audio than this say little about the per-second rate.
MIN_LEARN_AUDIO_S = 0.02
# Recent steps whose error ratio sets the spread, and the quantile taken.
SPREAD_WINDOW = 64
SPREAD_QUANTILE = 0.95
# Steps seen before the spread applies, and its ceiling.
SPREAD_MIN_STEPS = 16
MAX_SPREAD = 3.0
# Only steps estimated at least this long teach the spread: a tiny step's time is
# mostly fixed overhead the prior may not know (an executor hand-off), so its
# ratio says nothing about the steps near the budget that the spread is for.
SPREAD_MIN_ESTIMATE_S = 0.005


@dataclass
class CostModel:
    s_per_audio_s: float
    step_fixed_s: float = 0.0
    per_seq_s: float = 0.0
    alpha: float = 0.2
    steps_seen: int = 0
    spread: float = 1.0
    _ratios: deque[float] = field(default_factory=lambda: deque(maxlen=SPREAD_WINDOW))

    @classmethod
    def from_prior(cls, prior: CostPrior, alpha: float) -> CostModel:
        return cls(prior.s_per_audio_s, prior.step_fixed_s, prior.per_seq_s, alpha)

    def estimate_s(self, audio_s: float, seqs: int) -> float:
        return self._mean_s(audio_s, seqs) * self.spread

    def _mean_s(self, audio_s: float, seqs: int) -> float:
        if seqs == 0:
            return 0.0
        return self.step_fixed_s + self.per_seq_s * seqs + self.s_per_audio_s * audio_s

    def affordable_audio_s(self, budget_s: float, seqs: int) -> float:
        """Audio seconds a step with ``seqs`` streams can hold within ``budget_s``."""
        spare = budget_s / self.spread - self.step_fixed_s - self.per_seq_s * seqs
        return max(0.0, spare / self.s_per_audio_s) if self.s_per_audio_s > 0 else float("inf")

    def observe(self, measured_s: float, audio_s: float, seqs: int) -> None:
        if audio_s < MIN_LEARN_AUDIO_S or seqs == 0:
            return
        estimated = self._mean_s(audio_s, seqs)
        if estimated >= SPREAD_MIN_ESTIMATE_S:
            self._learn_spread(measured_s / estimated)
        overhead = self.step_fixed_s + self.per_seq_s * seqs
        implied = max(0.0, measured_s - overhead) / audio_s
        self.s_per_audio_s += self.alpha * (implied - self.s_per_audio_s)
        self.steps_seen += 1

    def _learn_spread(self, ratio: float) -> None:
        self._ratios.append(ratio)
        if len(self._ratios) < SPREAD_MIN_STEPS:
            return
        ordered = sorted(self._ratios)
        tail = ordered[min(len(ordered) - 1, int(SPREAD_QUANTILE * len(ordered)))]
        self.spread = min(MAX_SPREAD, max(1.0, tail))
