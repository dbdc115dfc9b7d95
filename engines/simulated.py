"""SIMULATED engine: a calibrated cost model of a GPU speech model, not a recognizer.

A step really occupies the worker for ``sim_step_fixed_ms + frames *
sim_prefill_frame_ms + seqs * sim_decode_seq_ms`` (frames = 10 ms of audio in
the step), sleeping (GIL released, like a GPU kernel) or spinning (GIL held,
like a CPU engine). The text is deterministic and derived from the audio
itself: one made-up word per voiced 400 ms block, spelled from a hash of the
block's samples, so different audio never yields the same words and any
chunking of the same audio yields the same text. It lets the scheduler be
tested and benchmarked at GPU-like scale on a CPU box.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence

import numpy as np

from engines.base import (
    BYTES_PER_SAMPLE,
    DEFAULT_OPTIONS,
    CostPrior,
    DecodeOptions,
    EngineStream,
    Hypothesis,
    Slots,
    StepProfile,
    check_pcm,
)
from lanegate.constants import ENGINE_SAMPLE_RATE
from lanegate.settings import Settings
from lanegate.transcript import Word

FRAME_SAMPLES = ENGINE_SAMPLE_RATE // 100
BLOCK_SAMPLES = ENGINE_SAMPLE_RATE * 400 // 1000
# A block quieter than this RMS (of 32768) holds no word.
SILENCE_RMS = 200.0
CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"

#: the one language this engine knows, reported on every hypothesis
LANGUAGE = "en"


def block_word(block: bytes) -> str | None:
    """The made-up word a voiced block 'says'; None for a quiet block."""
    samples = np.frombuffer(block, dtype=np.int16).astype(np.float64)
    if samples.size == 0 or float(np.sqrt(np.mean(samples * samples))) < SILENCE_RMS:
        return None
    digest = hashlib.blake2b(block, digest_size=6).digest()
    return "".join(CONSONANTS[b % len(CONSONANTS)] + VOWELS[(b >> 4) % len(VOWELS)]
                   for b in digest[:3])


def words_of(pcm: bytes) -> tuple[Word, ...]:
    """Words of whole blocks of an utterance, timed from its start."""
    block_bytes = BLOCK_SAMPLES * BYTES_PER_SAMPLE
    words: list[Word] = []
    for index, off in enumerate(range(0, len(pcm) - block_bytes + 1, block_bytes)):
        word = block_word(pcm[off : off + block_bytes])
        if word is not None:
            seconds = BLOCK_SAMPLES / ENGINE_SAMPLE_RATE
            words.append(Word(word, index * seconds, (index + 1) * seconds))
    return tuple(words)


#: exit status of a process that ``sim_fail_exit`` ends (EX_SOFTWARE)
FAULT_EXIT_CODE = 70


class SimulatedFault(RuntimeError):
    """The injected failure of ``sim_fail_on``."""


class SimulatedStream:
    def __init__(self, engine: SimulatedEngine) -> None:
        self._engine = engine
        self._words: list[Word] = []
        self._tail = bytearray()  # samples of the incomplete block
        self._blocks = 0

    def start(self) -> None:
        self._words.clear()
        self._tail.clear()
        self._blocks = 0

    def feed(self, pcm: bytes) -> Hypothesis:
        check_pcm(pcm)
        self._tail += pcm
        block_bytes = BLOCK_SAMPLES * BYTES_PER_SAMPLE
        whole = len(self._tail) // block_bytes * block_bytes
        for off in range(0, whole, block_bytes):
            self._add_block(bytes(self._tail[off : off + block_bytes]))
        del self._tail[:whole]
        return Hypothesis(" ".join(w.word for w in self._words), language=LANGUAGE)

    def _add_block(self, block: bytes) -> None:
        seconds = BLOCK_SAMPLES / ENGINE_SAMPLE_RATE
        word = block_word(block)
        if word is not None:
            self._words.append(Word(word, self._blocks * seconds, (self._blocks + 1) * seconds))
        self._blocks += 1

    def last_chunk(self) -> None:
        return None

    def finish(self) -> Hypothesis:
        if self._tail:
            self._add_block(bytes(self._tail))
        words = tuple(self._words)
        self.start()
        return Hypothesis(" ".join(w.word for w in words), words, language=LANGUAGE)

    def context_samples(self, last: bool = False) -> int:
        return 0  # incremental: a step decodes only its chunk

    def decodes_for_good(self, last: bool = False) -> bool:
        return False  # incremental: every step is one chunk's

    def rewind(self, samples: int) -> bool:
        return False  # incremental: the audio is consumed

    def close(self) -> None:
        self._engine.slots.give_back()


class SimulatedEngine:
    name = "simulated"
    sample_rate = ENGINE_SAMPLE_RATE

    def __init__(self, settings: Settings, *, slots: int) -> None:
        self.slots = Slots(slots, "simulated")
        self._fixed_s = settings.sim_step_fixed_ms / 1000
        self._frame_s = settings.sim_prefill_frame_ms / 1000
        self._seq_s = settings.sim_decode_seq_ms / 1000
        self._busy = settings.sim_busy_wait
        self._fail_on = settings.sim_fail_on
        self._fail_exit = settings.sim_fail_exit

    @property
    def slots_total(self) -> int:
        return self.slots.total

    def slots_free(self) -> int:
        return self.slots.free

    def open_stream(self, options: DecodeOptions = DEFAULT_OPTIONS) -> EngineStream:
        self.slots.take()
        return SimulatedStream(self)

    def step_cost_s(self, samples: int, seqs: int) -> float:
        """What the modelled GPU step would take for this much audio and these streams."""
        return self._fixed_s + samples / FRAME_SAMPLES * self._frame_s + seqs * self._seq_s

    def step(self, work: Sequence[tuple[EngineStream, bytes]]) -> list[Hypothesis]:
        samples = sum(len(pcm) for _, pcm in work) // BYTES_PER_SAMPLE
        self._occupy(self.step_cost_s(samples, len(work)))
        return [_as_sim(stream).feed(pcm) for stream, pcm in work]

    def transcribe_batch(self, segments: Sequence[bytes],
                         options: DecodeOptions = DEFAULT_OPTIONS) -> list[Hypothesis]:
        for segment in segments:
            check_pcm(segment)
        samples = sum(len(s) for s in segments) // BYTES_PER_SAMPLE
        self._occupy(self.step_cost_s(samples, len(segments)))
        out = []
        for segment in segments:
            words = words_of(segment)
            self._check_fault(words)
            out.append(Hypothesis(" ".join(w.word for w in words), words, language=LANGUAGE))
        return out

    def _check_fault(self, words: tuple[Word, ...]) -> None:
        if not self._fail_on or all(w.word != self._fail_on for w in words):
            return
        if self._fail_exit:
            os._exit(FAULT_EXIT_CODE)
        raise SimulatedFault(f"simulated engine fault on the word {self._fail_on!r}")

    def _occupy(self, seconds: float) -> None:
        if not self._busy:
            time.sleep(seconds)
            return
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            pass

    def cost_prior(self) -> CostPrior:
        return CostPrior(ENGINE_SAMPLE_RATE / FRAME_SAMPLES * self._frame_s, self._fixed_s,
                         self._seq_s)

    def last_profile(self) -> StepProfile | None:
        return None


def _as_sim(stream: EngineStream) -> SimulatedStream:
    if not isinstance(stream, SimulatedStream):
        raise TypeError(f"not a simulated stream: {type(stream).__name__}")
    return stream
