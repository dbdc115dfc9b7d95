"""The realtime lane's step cost model, learned online from measured steps.

Incremental engines (pocketsphinx, simulated): estimated step time = (fixed +
per_seq * streams + s_per_audio_s * audio seconds) x spread. Only the
per-audio-second rate is learned (an EWMA of what each measured step implies);
the fixed and per-stream terms are the engine's prior. So the mean holds on any
hardware: a slower machine raises the rate after a few steps.

Re-decoding engines (Whisper, an encoder-decoder): a step encodes every
sequence's whole segment, the batch padded to the longest, then generates;
estimated time = (fixed + seqs x (a F + b F^2) + c seqs + d tokens) x spread, for
F encoder frames per sequence (thousands, 10 ms each) and the decoder steps the
batch takes. The encoder polynomial (a, b) and the decoder terms (c, d) are each
fitted online by exponentially weighted least squares on what the engine reports
of its own steps (encoder and decoder timed apart), starting from the engine's
prior as if it had been seen ``PRIOR_WEIGHT`` times. The decoder steps a batch
will take is an EWMA of what recent steps took.

The spread keeps the tail under the budget too: it is the 95th percentile of
measured / estimated over recent steps estimated at 5 ms or more (at least 1,
at most 3). On a machine whose speed
varies from one step to the next (a shared or throttled VM), an estimate that is
right on average puts many steps over the budget; planning against the
estimate's recent tail does not.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from engines.base import CostPrior, StepProfile

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
# Re-decoding engines: frames are counted in thousands so that both coefficients of
# the encoder's polynomial are of order one; the prior counts as this many steps.
KILO = 1000.0
PRIOR_WEIGHT = 4.0


@dataclass
class OnlineFit:
    """y = coef . x, fitted by exponentially weighted ridge least squares, coef >= 0."""

    coef: npt.NDArray[np.float64]
    forget: float
    _xx: npt.NDArray[np.float64] = field(init=False)
    _xy: npt.NDArray[np.float64] = field(init=False)

    def __post_init__(self) -> None:
        # The prior as PRIOR_WEIGHT pseudo-observations along each axis.
        self._xx = np.eye(len(self.coef)) * PRIOR_WEIGHT
        self._xy = self._xx @ self.coef

    def predict(self, x: npt.NDArray[np.float64]) -> float:
        return float(self.coef @ x)

    def observe(self, x: npt.NDArray[np.float64], y: float) -> None:
        self._xx = self.forget * self._xx + np.outer(x, x)
        self._xy = self.forget * self._xy + x * y
        try:
            solved = np.linalg.solve(self._xx, self._xy)
        except np.linalg.LinAlgError:
            return
        self.coef = np.maximum(solved, 0.0)


@dataclass
class RedecodeCost:
    """The encoder polynomial and decoder terms of a re-decoding engine."""

    encoder: OnlineFit  # x = seqs * [F/KILO, (F/KILO)^2]
    decoder: OnlineFit  # x = [seqs, tokens]
    tokens_per_step: float
    pad_frames: int
    alpha: float

    @classmethod
    def from_prior(cls, prior: CostPrior, alpha: float) -> RedecodeCost:
        forget = 1.0 - alpha
        return cls(
            OnlineFit(np.array([prior.frame_s * KILO, prior.frame2_s * KILO * KILO]), forget),
            OnlineFit(np.array([prior.per_seq_s, prior.token_s]), forget),
            prior.tokens_per_step, prior.pad_frames, alpha)

    def encoder_s(self, seqs: int, frames: int) -> float:
        return self.encoder.predict(_frame_terms(seqs, frames))

    def decoder_s(self, seqs: int, tokens: float) -> float:
        return self.decoder.predict(np.array([float(seqs), tokens]))

    def observe(self, profile: StepProfile) -> None:
        self.encoder.observe(_frame_terms(profile.seqs, profile.frames), profile.encode_s)
        self.decoder.observe(np.array([float(profile.seqs), float(profile.tokens)]),
                             profile.decode_s)
        self.tokens_per_step += self.alpha * (profile.tokens - self.tokens_per_step)


def _frame_terms(seqs: int, frames: int) -> npt.NDArray[np.float64]:
    k = frames / KILO
    return np.array([seqs * k, seqs * k * k])


@dataclass
class CostModel:
    s_per_audio_s: float
    step_fixed_s: float = 0.0
    per_seq_s: float = 0.0
    alpha: float = 0.2
    steps_seen: int = 0
    spread: float = 1.0
    redecode: RedecodeCost | None = None
    _ratios: deque[float] = field(default_factory=lambda: deque(maxlen=SPREAD_WINDOW))

    @classmethod
    def from_prior(cls, prior: CostPrior, alpha: float) -> CostModel:
        redecode = RedecodeCost.from_prior(prior, alpha) if prior.redecodes else None
        return cls(prior.s_per_audio_s, prior.step_fixed_s, prior.per_seq_s, alpha,
                   redecode=redecode)

    # --- re-decoding engines ----------------------------------------------------------
    def redecode_estimate_s(self, seqs: int, frames: int) -> float:
        """A step of ``seqs`` sequences padded to ``frames`` encoder frames each."""
        return self._redecode_mean_s(seqs, frames) * self.spread

    def _redecode_mean_s(self, seqs: int, frames: int,
                         tokens: float | None = None) -> float:
        r = self.redecode
        if r is None or seqs == 0:
            return 0.0
        expected = r.tokens_per_step if tokens is None else tokens
        return self.step_fixed_s + r.encoder_s(seqs, frames) + r.decoder_s(seqs, expected)

    def observe_profile(self, measured_s: float, profile: StepProfile) -> None:
        """Learn from a re-decoding engine's step (its own split of the time)."""
        if self.redecode is None or profile.seqs == 0:
            return
        estimated = self._redecode_mean_s(profile.seqs, profile.frames, profile.tokens)
        if estimated >= SPREAD_MIN_ESTIMATE_S:
            self._learn_spread(measured_s / estimated)
        self.redecode.observe(profile)
        self.steps_seen += 1

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
        tail = percentile(self._ratios, SPREAD_QUANTILE)
        self.spread = min(MAX_SPREAD, max(1.0, tail))


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by rank, no interpolation; 0 when empty."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
