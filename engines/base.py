"""The engine protocol every recognizer implements (see docs/INTERNALS.md).

Engine calls are synchronous. pocketsphinx holds the GIL for a whole call, so
callers keep each call small (one scheduler step); Whisper (CTranslate2) releases
it in its encoder and decoder, so its step runs in a thread while the event loop
keeps relaying.

Two kinds of streaming engine fit the protocol: an incremental one (pocketsphinx,
simulated) consumes each chunk once; a re-decoding one (Whisper) keeps the audio
of its current segment and decodes all of it again each step. ``CostPrior.redecodes``
tells the scheduler which, since the cost of a re-decode grows with the segment,
not with the chunk.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from lanegate.constants import SAMPLE_WIDTH
from lanegate.transcript import Word

BYTES_PER_SAMPLE = SAMPLE_WIDTH  # s16le, as everywhere in lanegate


class NoFreeSlot(RuntimeError):
    """Every decoder slot of the engine is taken."""


class Slots:
    """A fixed number of stream slots of an engine whose streams hold no native decoder
    each (simulated, Whisper): taken by ``open_stream``, given back by the stream's
    ``close``, from any thread."""

    def __init__(self, total: int, engine: str) -> None:
        self.total = total
        self._engine = engine
        self._in_use = 0
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        return self.total - self._in_use

    def take(self) -> None:
        with self._lock:
            if self._in_use >= self.total:
                raise NoFreeSlot(f"all {self.total} {self._engine} slots are in use")
            self._in_use += 1

    def give_back(self) -> None:
        with self._lock:
            self._in_use -= 1


@dataclass(frozen=True)
class Hypothesis:
    text: str
    words: tuple[Word, ...] = ()  # times in seconds from the utterance start
    language: str = ""  # ISO code the engine used or detected; "" if unknown


class Task(StrEnum):
    """What the decoder writes: the speech's own language, or English (Whisper's
    ``translate`` task; an English-only engine's transcript already is)."""

    TRANSCRIBE = "transcribe"
    TRANSLATE = "translate"


@dataclass(frozen=True)
class DecodeOptions:
    """What a client may ask of the decoder; an engine ignores what it cannot do."""

    language: str | None = None  # None: detect it (if the engine can); the speech's
    prompt: str = ""  # text that conditions the decoder (Whisper's initial prompt)
    temperature: float = 0.0  # 0: greedy / beam search
    task: Task = Task.TRANSCRIBE  # TRANSLATE: English text whatever the speech's language


DEFAULT_OPTIONS = DecodeOptions()


@dataclass(frozen=True)
class CostPrior:
    """An engine's own guess of what a step costs, before anything is measured.

    Incremental engines: ``fixed + per_seq x streams + s_per_audio_s x audio``.
    Re-decoding engines (``redecodes``): per sequence ``frame_s x F + frame2_s x F^2``
    for its ``F`` encoder frames (10 ms, the whole segment plus padding), and
    ``token_s`` per generated token of the batch.
    """

    s_per_audio_s: float
    step_fixed_s: float = 0.0
    per_seq_s: float = 0.0
    redecodes: bool = False
    frame_s: float = 0.0
    frame2_s: float = 0.0
    token_s: float = 0.0
    tokens_per_step: float = 0.0  # decoder steps a batch is expected to take
    pad_frames: int = 0  # encoder frames added to every sequence (trailing silence)


@dataclass(frozen=True)
class StepProfile:
    """What a re-decoding engine's last step did, for the cost model to learn from."""

    seqs: int
    frames: int  # encoder frames per sequence (the batch is padded to the longest)
    encode_s: float
    tokens: int  # decoder steps (the longest generation in the batch)
    decode_s: float


class EngineStream(Protocol):
    """One decoder slot."""

    def start(self) -> None:
        """Begin a new utterance."""

    def last_chunk(self) -> None:
        """The chunk of the coming step ends the utterance (a re-decoding engine
        decodes it for the final then)."""

    def finish(self) -> Hypothesis:
        """End the utterance; the final hypothesis with word timings."""

    def rewind(self, samples: int) -> bool:
        """Forget the utterance's audio past its first ``samples`` (16 kHz); False if the
        engine cannot (an incremental one has consumed it)."""

    def context_samples(self, last: bool = False) -> int:
        """Audio the next step decodes besides its new chunk (16 kHz samples): 0 for an
        incremental engine; a re-decoding one's window (``last``: the step that takes the
        utterance's last chunk, its final's decode)."""

    def decodes_for_good(self, last: bool = False) -> bool:
        """The next step decodes part of the utterance for good (a re-decoding engine's
        final, ``last``, or a finished piece of a long utterance): a long decode that
        brings no fresher partial, which the realtime planner keeps out of the steps
        that serve other sessions' partials. Always False for an incremental engine."""

    def close(self) -> None:
        """Give the slot back."""


class Engine(Protocol):
    name: str
    sample_rate: int

    @property
    def slots_total(self) -> int: ...

    def slots_free(self) -> int: ...

    def open_stream(self, options: DecodeOptions = DEFAULT_OPTIONS) -> EngineStream:
        """A started stream bound to a free slot; raises NoFreeSlot."""

    def step(self, work: Sequence[tuple[EngineStream, bytes]]) -> list[Hypothesis]:
        """One scheduler step: feed each stream its PCM chunk, return each partial."""

    def transcribe_batch(self, segments: Sequence[bytes],
                         options: DecodeOptions = DEFAULT_OPTIONS) -> list[Hypothesis]:
        """The batch lane's call: whole segments (at most max_window_s each)."""

    def cost_prior(self) -> CostPrior:
        """The starting cost estimate (per audio second or per frame, per step, per stream)."""

    def last_profile(self) -> StepProfile | None:
        """The split of the last step's time, where the engine measures it."""


def check_pcm(pcm: bytes) -> None:
    if len(pcm) % BYTES_PER_SAMPLE:
        raise ValueError(f"PCM s16le needs an even byte count, got {len(pcm)}")
