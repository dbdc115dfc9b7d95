"""The engine protocol every recognizer implements (see docs/INTERNALS.md).

Engine calls are synchronous and may hold the GIL for their whole duration
(pocketsphinx does): callers keep each call small (one scheduler step) and
return to the event loop between calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from lanegate.transcript import Word

BYTES_PER_SAMPLE = 2


class NoFreeSlot(RuntimeError):
    """Every decoder slot of the engine is taken."""


@dataclass(frozen=True)
class Hypothesis:
    text: str
    words: tuple[Word, ...] = ()  # times in seconds from the utterance start


@dataclass(frozen=True)
class CostPrior:
    """An engine's own guess of what a step costs, before anything is measured."""

    s_per_audio_s: float
    step_fixed_s: float = 0.0
    per_seq_s: float = 0.0


class EngineStream(Protocol):
    """One decoder slot."""

    def start(self) -> None:
        """Begin a new utterance."""

    def finish(self) -> Hypothesis:
        """End the utterance; the final hypothesis with word timings."""

    def close(self) -> None:
        """Give the slot back."""


class Engine(Protocol):
    name: str
    sample_rate: int
    slots_total: int

    def slots_free(self) -> int: ...

    def open_stream(self) -> EngineStream:
        """A started stream bound to a free slot; raises NoFreeSlot."""

    def step(self, work: Sequence[tuple[EngineStream, bytes]]) -> list[Hypothesis]:
        """One scheduler step: feed each stream its PCM chunk, return each partial."""

    def transcribe_batch(self, segments: Sequence[bytes]) -> list[Hypothesis]:
        """The batch lane's call: whole segments (at most max_window_s each)."""

    def cost_prior_s_per_audio_s(self) -> float:
        """The scheduler's starting cost estimate per audio second."""

    def cost_prior(self) -> CostPrior:
        """The full starting cost estimate (per audio second, per step, per stream)."""


def audio_seconds(pcm_bytes: int, sample_rate: int) -> float:
    return pcm_bytes / BYTES_PER_SAMPLE / sample_rate


def check_pcm(pcm: bytes) -> None:
    if len(pcm) % BYTES_PER_SAMPLE:
        raise ValueError(f"PCM s16le needs an even byte count, got {len(pcm)}")
