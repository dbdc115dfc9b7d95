"""The realtime lane's step cost model, learned online from measured steps.

Estimated step time = fixed + per_seq * streams + s_per_audio_s * audio seconds.
Only the per-audio-second rate is learned (an EWMA of what each measured step
implies); the fixed and per-stream terms are the engine's prior. So the budget
holds on any hardware: a slower machine raises the rate after a few steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.engines.base import CostPrior

# Steps with less audio than this say little about the per-second rate.
MIN_LEARN_AUDIO_S = 0.02


@dataclass
class CostModel:
    s_per_audio_s: float
    step_fixed_s: float = 0.0
    per_seq_s: float = 0.0
    alpha: float = 0.2
    steps_seen: int = 0

    @classmethod
    def from_prior(cls, prior: CostPrior, alpha: float) -> CostModel:
        return cls(prior.s_per_audio_s, prior.step_fixed_s, prior.per_seq_s, alpha)

    def estimate_s(self, audio_s: float, seqs: int) -> float:
        if seqs == 0:
            return 0.0
        return self.step_fixed_s + self.per_seq_s * seqs + self.s_per_audio_s * audio_s

    def affordable_audio_s(self, budget_s: float, seqs: int) -> float:
        """Audio seconds a step with ``seqs`` streams can hold within ``budget_s``."""
        spare = budget_s - self.step_fixed_s - self.per_seq_s * seqs
        return max(0.0, spare / self.s_per_audio_s) if self.s_per_audio_s > 0 else float("inf")

    def observe(self, measured_s: float, audio_s: float, seqs: int) -> None:
        if audio_s < MIN_LEARN_AUDIO_S or seqs == 0:
            return
        overhead = self.step_fixed_s + self.per_seq_s * seqs
        implied = max(0.0, measured_s - overhead) / audio_s
        self.s_per_audio_s += self.alpha * (implied - self.s_per_audio_s)
        self.steps_seen += 1
