"""The embedded default engine: CMU pocketsphinx with the model its wheel ships.

Decoders cost about 90 MB and 0.3-0.5 s each to load, so the slot pool is
built once at start; one extra decoder serves ``transcribe_batch``.
``process_raw`` holds the GIL for its whole call, so callers keep calls small.
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Sequence
from typing import Any

from pocketsphinx import Decoder

from engines.base import (
    BYTES_PER_SAMPLE,
    DEFAULT_OPTIONS,
    CostPrior,
    DecodeOptions,
    EngineStream,
    Hypothesis,
    NoFreeSlot,
    StepProfile,
    check_pcm,
)
from lanegate.constants import ENGINE_SAMPLE_RATE
from lanegate.settings import Settings
from lanegate.transcript import Word

FRAMES_PER_SECOND = 100
# A stream hands its decoder whole blocks of this many bytes (20 ms), counted from the
# utterance's start, and keeps the rest for the next feed: pocketsphinx's words depend
# on where its calls split the audio, and a step's chunk depends on timing.
FEED_BLOCK_BYTES = 320 * BYTES_PER_SAMPLE
# Audio handed to the batch decoder per call, so a caller can yield between pieces.
BATCH_PIECE_S = 1.0
# Measured on this project's machine (RTF about 0.24 with maxhmmpf=1500, ds=2).
PRIOR_S_PER_AUDIO_S = 0.25
PRIOR_STEP_FIXED_S = 0.0005
PRIOR_PER_SEQ_S = 0.0003

#: the one language this engine knows, reported on every hypothesis
LANGUAGE = "en"


def decoder_config(settings: Settings, *, fwdflat: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "maxhmmpf": settings.ps_maxhmmpf, "ds": settings.ps_ds, "loglevel": "FATAL",
        "fwdflat": fwdflat,
    }
    for key, value in (("hmm", settings.ps_hmm), ("lm", settings.ps_lm),
                       ("dict", settings.ps_dict)):
        if value:
            config[key] = value
    return config


def fresh_features(decoder: Any) -> None:
    """Start the decoder's feature extraction over, as if newly loaded (about 0.1 ms).

    Every session, and every batch segment, so no audio of an earlier one shapes its
    text and a result does not depend on which slot a session got. ``set_cmn`` is
    not enough: it sets the live cepstral mean, but the mean's next updates still
    depend on the audio before (the same clip after different clips ends with a
    different mean and different words).
    """
    decoder.reinit_feat()


def is_filler(word: str) -> bool:
    return word.startswith(("<", "[", "+")) or word == ""


def clean_word(word: str) -> str:
    """``read(2)`` -> ``read``: strip the pronunciation variant."""
    return word.split("(", 1)[0]


def final_hypothesis(decoder: Any) -> Hypothesis:
    """Words and timings of the utterance the decoder just ended (none for an
    utterance too short to search: ``seg()`` is then None)."""
    words = tuple(
        Word(clean_word(s.word), s.start_frame / FRAMES_PER_SECOND,
             (s.end_frame + 1) / FRAMES_PER_SECOND)
        for s in decoder.seg() or () if not is_filler(s.word)
    )
    return Hypothesis(" ".join(w.word for w in words), words, language=LANGUAGE)


def partial_text(decoder: Any) -> str:
    hyp = decoder.hyp()
    return "" if hyp is None else str(hyp.hypstr)


class PocketsphinxStream:
    """One preloaded decoder lent to a session."""

    def __init__(self, engine: PocketsphinxEngine, decoder: Any) -> None:
        self._engine = engine
        self.decoder = decoder
        self._in_utt = False
        self._held = bytearray()  # the part of a block fed so far

    def start(self) -> None:
        if self._in_utt:
            self.decoder.end_utt()
        self._held.clear()
        self.decoder.start_utt()
        self._in_utt = True

    def feed(self, pcm: bytes) -> Hypothesis:
        check_pcm(pcm)
        self._held += pcm
        whole = len(self._held) - len(self._held) % FEED_BLOCK_BYTES
        with memoryview(self._held) as held:  # no copy per block; released before the del
            for off in range(0, whole, FEED_BLOCK_BYTES):
                self.decoder.process_raw(held[off:off + FEED_BLOCK_BYTES], False, False)
        del self._held[:whole]
        return Hypothesis(partial_text(self.decoder), language=LANGUAGE)

    def last_chunk(self) -> None:
        return None

    def finish(self) -> Hypothesis:
        if not self._in_utt:
            return Hypothesis("", language=LANGUAGE)
        if self._held:
            self.decoder.process_raw(self._held, False, False)
            self._held.clear()
        self.decoder.end_utt()
        self._in_utt = False
        return final_hypothesis(self.decoder)

    def context_samples(self, last: bool = False) -> int:
        return 0  # incremental: a step decodes only its chunk

    def decodes_for_good(self, last: bool = False) -> bool:
        return False  # incremental: every step is one chunk's

    def rewind(self, samples: int) -> bool:
        return False  # incremental: the audio is consumed

    def close(self) -> None:
        if self._in_utt:
            self.decoder.end_utt()
            self._in_utt = False
        self._engine._release(self.decoder)


class PocketsphinxEngine:
    name = "pocketsphinx"
    sample_rate = ENGINE_SAMPLE_RATE

    def __init__(self, settings: Settings, *, slots: int, batch_decoder: bool = True) -> None:
        self.slots_total = slots
        stream_config = decoder_config(settings, fwdflat=settings.ps_fwdflat)
        self._free: list[Any] = [Decoder(**stream_config) for _ in range(slots)]
        self._lock = threading.Lock()
        # The batch decoder keeps the second pass: throughput, not a step beat, is its goal.
        self._batch: Any = Decoder(**decoder_config(settings, fwdflat=True)) \
            if batch_decoder else None

    def slots_free(self) -> int:
        return len(self._free)

    def open_stream(self, options: DecodeOptions = DEFAULT_OPTIONS) -> EngineStream:
        with self._lock:
            if not self._free:
                raise NoFreeSlot(f"all {self.slots_total} pocketsphinx slots are in use")
            decoder = self._free.pop()
        fresh_features(decoder)
        stream = PocketsphinxStream(self, decoder)
        stream.start()
        return stream

    def _release(self, decoder: Any) -> None:
        with self._lock:
            self._free.append(decoder)

    def step(self, work: Sequence[tuple[EngineStream, bytes]]) -> list[Hypothesis]:
        return [_as_ps(stream).feed(pcm) for stream, pcm in work]

    def transcribe_batch(self, segments: Sequence[bytes],
                         options: DecodeOptions = DEFAULT_OPTIONS) -> list[Hypothesis]:
        out: list[Hypothesis] = []
        for segment in segments:
            for result in self.transcribe_segment_pieces(segment):
                if result is not None:
                    out.append(result)
        return out

    def transcribe_segment_pieces(
        self, segment: bytes
    ) -> Generator[Hypothesis | None, None, None]:
        """Decode one segment in about 1 s pieces: yields None after each piece, then
        the final hypothesis, so a caller can return to its event loop in between."""
        check_pcm(segment)
        if self._batch is None:
            raise NoFreeSlot("this engine was built without a batch decoder")
        piece = int(BATCH_PIECE_S * self.sample_rate) * BYTES_PER_SAMPLE
        decoder = self._batch
        fresh_features(decoder)
        decoder.start_utt()
        try:
            for off in range(0, len(segment), piece):
                decoder.process_raw(segment[off : off + piece], False, False)
                yield None
        finally:
            decoder.end_utt()
        yield final_hypothesis(decoder)

    def cost_prior(self) -> CostPrior:
        return CostPrior(PRIOR_S_PER_AUDIO_S, PRIOR_STEP_FIXED_S, PRIOR_PER_SEQ_S)

    def last_profile(self) -> StepProfile | None:
        return None


def _as_ps(stream: EngineStream) -> PocketsphinxStream:
    if not isinstance(stream, PocketsphinxStream):
        raise TypeError(f"not a pocketsphinx stream: {type(stream).__name__}")
    return stream
