"""Whisper on CTranslate2: the embedded default engine, in both lanes.
(Over 400 lines: the batched step, its segment bookkeeping and the batch call share
the model, the tokenizer and the rejection rules.)

faster-whisper loads the model directory and lends its feature extractor,
tokenizer and word aligner; the calls that matter go straight to
``ctranslate2.models.Whisper`` so that one call encodes and decodes several
sessions' segments at once (CTranslate2 releases the GIL in them).

Whisper is not incremental: a stream keeps the audio of its current segment, and
each step re-decodes all of it. What keeps that affordable:

* only the segment is encoded, plus ``whisper_pad_ms`` of trailing silence, not a
  30 s window (the encoder's cost grows with its frames; see docs/ARCHITECTURE.md
  for the figures), and leading non-speech is dropped;
* generation runs with timestamps: cut at the speech without them, the decoder
  repeats the sentence until ``max_length``; with them it ends at the end
  timestamp. Generated tokens are also capped per second of audio;
* the committed words (LocalAgreement-2, ``engines.agreement``) are forced as the
  decoder's prefix, so a re-decode generates only the unstable tail, and partial
  text never takes a committed word back;
* a segment with too little VAD speech is not decoded at all, and a decode the
  model itself calls no-speech gives no text (noise and silence give nothing).

A step decodes with word alignment. The step that takes a segment's last chunk
(the session says so: ``last_chunk``) decodes it afresh, without the committed
prefix, the same call as the batch lane's: a word committed early and wrongly is
corrected in the final, and the final is the whole-segment decode the raw engine
would give. ``finish`` then returns it at no cost on the event loop.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ctranslate2
import numpy as np
import numpy.typing as npt
import webrtcvad
from faster_whisper import WhisperModel
from faster_whisper.tokenizer import Tokenizer
from faster_whisper.transcribe import merge_punctuations

from engines import models
from engines.agreement import LocalAgreement, comparable
from engines.base import (
    BYTES_PER_SAMPLE,
    DEFAULT_OPTIONS,
    CostPrior,
    DecodeOptions,
    EngineStream,
    Hypothesis,
    Slots,
    StepProfile,
    Task,
    check_pcm,
)
from lanegate.constants import ENGINE_SAMPLE_RATE
from lanegate.settings import ComputeType, Device, Settings
from lanegate.transcript import Word

RATE = ENGINE_SAMPLE_RATE
FRAMES_PER_S = 100  # mel frames (the encoder's input)
MAX_FRAMES = 3000  # Whisper's 30 s window
VAD_FRAME = RATE * 30 // 1000  # samples per webrtcvad frame
TIMESTAMP_S = 0.02  # Whisper's timestamp token resolution
# A language detected on this much speech is kept for the rest of the session.
LANGUAGE_FIX_S = 2.0
# A word starting this long after the last voiced frame was not said (webrtcvad frames
# are 30 ms; the aligner's timings 20 ms).
VOICED_SLACK_S = 0.1
# A window's word starting this little before the last committed word's end is new.
WORD_OVERLAP_S = 0.1
# Unvoiced 30 ms frames in a row that make a pause a piece of a segment may end in.
PAUSE_FRAMES = 4
# Silence added after a final's audio (besides whisper_pad_ms): the batch lane pads each
# segment to the longest of its batch, and with 0.5 s alone the stream's finals of an
# espeak-ng clip (10 sentences, 110 words) made 9 errors, with 1.0 s more 7, 2.5 s more
# 6 (the batch lane: 4; one word is the noise of one run); the shared recording 3 with each.
FINAL_PAD_SAMPLES = RATE
# A step decodes a segment only once it holds this much audio from its speech's start.
MIN_STEP_AUDIO_S = 1.0
# Tokens generated per step at most: a base and a per-audio-second allowance.
BASE_TOKENS = 8
# faster-whisper's defaults: punctuation merged into the word before or after it.
PREPEND_PUNCTUATION = "\"'“¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"
# Measured on one core of this project's machine, Whisper base int8 (docs/ARCHITECTURE.md).
PRIOR_FIXED_S = 0.005
PRIOR_FRAME_S = 0.00025
PRIOR_FRAME2_S = 2.0e-8
PRIOR_TOKEN_S = 0.015
PRIOR_TOKENS_PER_STEP = 8.0
# Whisper's previous-text context holds at most this many tokens (half its 448).
PROMPT_TOKENS = 223
#: the batch lane pads a window to the next multiple of this (at most Whisper's 30 s),
#: and batches it only with windows padded alike, so that what a window decodes to does
#: not hang on the windows (other users' jobs among them) it shares a call with
BATCH_PAD_GRID_S = 5


def resolve_device(device: Device) -> str:
    if device is Device.AUTO:
        return "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
    return device.value


def default_compute_type(device: str) -> str:
    return "float16" if device == "cuda" else "int8"


def default_threads() -> int:
    return len(os.sched_getaffinity(0))


def as_float(pcm: bytes | bytearray) -> npt.NDArray[np.float32]:
    return np.frombuffer(pcm, dtype=np.int16).astype(np.float32) / 32768.0


def drop_repeats(tokens: Sequence[int], eot: int, timestamp_begin: int, audio_s: float,
                 words_of: Callable[[list[int]], list[str]]) -> list[int]:
    """The text tokens of a timestamped generation, without a segment that repeats
    an earlier one (whole or cut short; compared as words, case and punctuation
    aside) where too little audio is left to say it: cut close to the speech,
    Whisper sometimes says the sentence again after its end timestamp (measured: 3
    of 18 espeak-ng clips with 1-2 s of silence after them). A repeat with room
    for it in the audio is speech said twice, and kept."""
    segments: list[tuple[float, list[int]]] = []  # (start s, text tokens)
    start = 0.0
    for token in tokens:
        if token >= timestamp_begin:
            if segments and not segments[-1][1]:
                segments.pop()
            start = (token - timestamp_begin) * TIMESTAMP_S
            segments.append((start, []))
        elif token < eot:
            if not segments:
                segments.append((start, []))
            segments[-1][1].append(token)
    kept: list[tuple[float, float, list[int], list[str]]] = []  # (start, end, tokens, words)
    for index, (begin, text) in enumerate(segments):
        if not text:
            continue
        words = [comparable(w) for w in words_of(text)]
        end = segments[index + 1][0] if index + 1 < len(segments) else audio_s
        said = [e - b for b, e, _, seen in kept if _repeats(words, seen)]
        if said and audio_s - begin < 0.5 * max(said):
            continue
        kept.append((begin, max(begin, end), text, words))
    return [t for _, _, text, _ in kept for t in text]


def _repeats(words: list[str], earlier: list[str]) -> bool:
    """``words`` say ``earlier`` again from its start (the last word may be cut)."""
    if not words or len(words) > len(earlier):
        return False
    head, last = words[:-1], words[-1]
    return earlier[: len(head)] == head and earlier[len(head)].startswith(last)


def compression_ratio(text: str) -> float:
    raw = text.encode("utf-8")
    return len(raw) / max(1, len(zlib.compress(raw)))


class SpeechGate:
    """webrtcvad over a stream's segment, as it grows: where speech starts, how much."""

    def __init__(self, aggressiveness: int) -> None:
        self._vad = webrtcvad.Vad(aggressiveness)
        self._tail = b""
        self._frames = 0
        self.speech_frames = 0
        self.first_speech: int | None = None  # sample index
        self.voiced_end = 0  # sample index: the end of the last speech frame so far
        self.voiced: list[bool] = []  # each frame's verdict

    def push(self, pcm: bytes) -> None:
        data = self._tail + pcm
        size = VAD_FRAME * BYTES_PER_SAMPLE
        whole = len(data) // size * size
        for off in range(0, whole, size):
            speech = self._vad.is_speech(data[off : off + size], RATE)
            self.voiced.append(speech)
            if speech:
                self.speech_frames += 1
                if self.first_speech is None:
                    self.first_speech = self._frames * VAD_FRAME
                self.voiced_end = (self._frames + 1) * VAD_FRAME
            self._frames += 1
        self._tail = data[whole:]

    @property
    def speech_s(self) -> float:
        return self.speech_frames * VAD_FRAME / RATE


@dataclass
class Decoded:
    """One sequence's decode: what the batch call returns for it."""

    tokens: list[int]  # text tokens (committed prefix included)
    words: list[Word]  # seconds from the decoded audio's start
    word_tokens: list[list[int]]  # the tokens of each word (punctuation merged in)
    language: str
    no_speech: bool


@dataclass
class Job:
    """One sequence of a batched decode."""

    audio: npt.NDArray[np.float32]
    language: str | None
    prefix: list[int] = field(default_factory=list)
    prompt: str = ""
    temperature: float = 0.0
    task: Task = Task.TRANSCRIBE
    #: generate Whisper's timestamp tokens (the live lane's steps place their prefix and
    #: cut repeats with them); False: text only, as faster-whisper's batched pipeline
    #: decodes a window (words are timed by alignment either way)
    timestamps: bool = True


class WhisperStream:
    """One decoder slot: the audio of the current segment and what is committed of it.

    A step decodes a window, not the segment: it starts at a committed word's end about
    ``whisper_lookback_ms`` before the first word not yet committed (no earlier than the
    segment's speech), and is never longer than ``whisper_step_window_s``. Neither the
    committed words in the window (forced as a prefix) nor those before it (as the
    prompt) condition the decoder: measured on a dialogue that repeats lines, the
    committed text as the prompt made the decoder loop ("Yes. Yes. Yes.") and partials
    stall 3.9 s, 1.7 s without it; a forced prefix that was wrong froze the stream
    (every later decode judged a loop). The window's words past the committed ones
    (``past``) are the news. The final (``closing``) decodes the whole segment afresh,
    as the batch lane does, and detects the language on it when the client gave none.
    A long segment is decoded for good in pieces at its pauses (``piece_job``), each in
    a step that decodes nothing else of the stream (``decodes_for_good``).
    """

    def __init__(self, engine: WhisperEngine, options: DecodeOptions) -> None:
        self._engine = engine
        self.options = options
        self.language = options.language
        self.start()

    def start(self) -> None:
        self.audio = bytearray()
        self.gate = SpeechGate(self._engine.vad_aggressiveness)
        self.agreement = LocalAgreement()
        self.words: list[Word] = []  # the committed words (seconds from the segment start)
        self.tokens: list[list[int]] = []  # each committed word's tokens
        self._tentative: list[tuple[Word, list[int]]] = []  # the last hypothesis past them
        self._kept = 0  # committed words before the decoded window
        self.sealed: list[Word] = []  # final text of the segment's audio up to sealed_end
        self.sealed_end = 0  # sample
        self._sealing: tuple[int, int] | None = None  # (start, end) the step decodes to seal
        self.hyp = Hypothesis("", (), self.language or "")
        self.partial = Hypothesis("", (), self.language or "")
        self.decoded = 0  # bytes of audio that ``hyp`` covers
        self.offset_s = 0.0  # where the decoded audio starts in the segment
        self.closing = False  # the next decode is the final: the whole segment, afresh

    @property
    def committed(self) -> list[int]:
        """The tokens of the committed words."""
        return [t for group in self.tokens for t in group]

    def last_chunk(self) -> None:
        self.closing = True

    def append(self, pcm: bytes) -> None:
        check_pcm(pcm)
        self.audio += pcm
        self.gate.push(pcm)

    @property
    def stale(self) -> bool:
        return self.decoded != len(self.audio)

    def rewind(self, samples: int) -> bool:
        """The segment's audio past ``samples`` is forgotten (a cut found behind it)."""
        del self.audio[samples * BYTES_PER_SAMPLE :]
        self.gate = SpeechGate(self._engine.vad_aggressiveness)
        self.gate.push(bytes(self.audio))
        self._tentative = [(w, t) for w, t in self._tentative if w.end * RATE <= samples]
        while self.words and self.words[-1].end * RATE > samples:
            self.words.pop()
            self.tokens.pop()
        while self.sealed and self.sealed[-1].end * RATE > samples:
            self.sealed.pop()
        if self.sealed_end > samples:
            self.sealed_end = round(self.sealed[-1].end * RATE) if self.sealed else 0
        self.agreement.reset()
        self.agreement.committed = len(self.words)
        self.decoded = -1  # stale: the next step decodes again
        return True

    def context_samples(self, last: bool = False) -> int:
        """Audio of the segment the next step decodes besides new audio: its window, a
        piece to seal, or (``last``: the final) what is not sealed yet."""
        end = len(self.audio) // BYTES_PER_SAMPLE
        if last or self.closing:
            return end - self._final_start() + FINAL_PAD_SAMPLES
        span = self._seal_span()
        window = end - self._window_start()
        return window if span is None else max(window, span[1] - span[0])

    def decodes_for_good(self, last: bool = False) -> bool:
        """The next step decodes the final (``last``) or a piece to seal."""
        return last or self.closing or self._seal_span() is not None

    def _final_start(self) -> int:
        return max(self._speech_start(), self.sealed_end)

    def _seal_span(self) -> tuple[int, int] | None:
        """A piece of the segment to decode for good now, as the final would: from the
        sealed end to the middle of the longest pause (``PAUSE_FRAMES`` unvoiced frames
        or more) that leaves it between half the step window and the whole, before the
        last committed word; None until the committed words reach that far, or if there
        is no such pause. So the final decodes about a step window after the pieces
        before it: with pauses, no step, the final's included, grows with the segment."""
        window = self._engine.step_window_samples
        start = self._final_start()
        if len(self.words) < 2 or self.words[-1].end * RATE - start < 0.8 * window:
            return None
        limit = min(start + window, round(self.words[-1].end * RATE))
        cut = quietest(self.gate.voiced, start + window // 2, limit)
        # Speech without a pause is not cut: measured on a 28 s espeak-ng monologue, pieces
        # cut between two committed words (their timing refined to the quietest 10 ms)
        # split words and made 12 errors in 90 words, the whole segment's decode 5.
        return None if cut is None else (start, cut)

    def _speech_start(self) -> int:
        first = self.gate.first_speech or 0
        end = len(self.audio) // BYTES_PER_SAMPLE
        return max(0, first - self._engine.pad_samples, end - self._engine.max_audio_samples)

    def _window_start(self) -> int:
        """Where a step's window starts (a sample); committed words before it are
        ``_kept``. Words of the last hypothesis that the window's cap leaves behind
        are committed as they were (rare: two decodes kept disagreeing about them)."""
        engine = self._engine
        end = len(self.audio) // BYTES_PER_SAMPLE
        floor = max(self._speech_start(), end - engine.step_window_samples)
        if self._tentative and self._tentative[0][0].end * RATE <= floor + engine.lookback_samples:
            behind = floor / RATE + engine.lookback_s
            while self._tentative and self._tentative[0][0].end <= behind:
                word, tokens = self._tentative.pop(0)
                self.words.append(word)
                self.tokens.append(tokens)
            self.agreement.committed = len(self.words)
        open_at = self.words[-1].end if self.words else 0.0
        target = max(open_at - engine.lookback_s, floor / RATE)
        kept = 0
        while kept < len(self.words) and self.words[kept].end <= target:
            kept += 1
        self._kept = kept
        start = round(self.words[kept - 1].end * RATE) if kept else 0
        return max(floor, start)

    def piece_job(self) -> Job | None:
        """A piece to decode for good in this step instead of the window (None: none
        due); the window waits for the next step, which the planner keeps apart."""
        self._sealing = None if self.closing else self._seal_span()
        if self._sealing is None:
            return None
        start, end = self._sealing
        language = self.language if self.sealed else self.options.language
        return Job(as_float(self.audio[start * BYTES_PER_SAMPLE : end * BYTES_PER_SAMPLE]),
                   language, [], self.options.prompt, self.options.temperature,
                   self.options.task)

    def take_piece(self, decoded: Decoded) -> None:
        """The piece's decode: its words are final text (without those past the pause it
        ends in); a doubtful one keeps the words the steps committed there."""
        assert self._sealing is not None
        start, cut = self._sealing
        if decoded.no_speech:
            words = [w for w in self.words if w.end * RATE <= cut]
        else:
            voiced = max((w.end for w in self.words if w.end * RATE <= cut), default=cut / RATE)
            offset = start / RATE
            words = [w for w, _ in said(
                [(Word(w.word, w.start + offset, w.end + offset), t)
                 for w, t in zip(decoded.words, decoded.word_tokens, strict=True)],
                voiced, cut / RATE)]
        self.sealed += [w for w in words if w.start * RATE < cut and
                        w.start * RATE >= start - VOICED_SLACK_S * RATE]
        self.sealed_end = cut
        self._sealing = None

    def job(self) -> Job:
        """The audio to decode: the window (a step) or the whole segment (the final)."""
        end = len(self.audio) // BYTES_PER_SAMPLE
        if self.closing:
            start = self._final_start()
            self._kept = 0
            # None: detected on the whole segment (or its first piece)
            language = self.options.language if not self.sealed else self.language
        else:
            start = self._window_start()
            language = self.language
        self.offset_s = start / RATE
        pcm = as_float(self.audio[start * BYTES_PER_SAMPLE : end * BYTES_PER_SAMPLE])
        if self.closing:
            pcm = np.concatenate([pcm, np.zeros(FINAL_PAD_SAMPLES, dtype=np.float32)])
        return Job(pcm, language, [], self.options.prompt, self.options.temperature,
                   self.options.task)

    def ready(self) -> bool:
        """Worth decoding: enough speech, and (a step) enough audio from the speech's start
        that Whisper does not guess (under a second it makes up words)."""
        engine = self._engine
        if self.gate.speech_s < engine.min_speech_s:
            return False
        end = len(self.audio) // BYTES_PER_SAMPLE
        return self.closing or end - self._speech_start() >= MIN_STEP_AUDIO_S * RATE

    def take(self, decoded: Decoded | None) -> None:
        """A decode of the window or the segment (None: not worth decoding, no text)."""
        self.decoded = len(self.audio)
        if decoded is None or decoded.no_speech:
            # Committed words stay: a doubtful decode (of the tail, or the fresh final one)
            # does not unsay what two decodes agreed on. Noise never has any.
            empty = Hypothesis("", (), self.language or "")
            if self.closing:
                rest = [w for w in self.words if w.start * RATE >= self.sealed_end]
                words = self.sealed + rest
                self.hyp = Hypothesis(" ".join(w.word for w in words), tuple(words),
                                      self.language or "") if words else empty
                self.partial = empty
                return
            # A step judged doubtful (its window's tail looping, say): the last hypothesis
            # still stands, and its words that are old enough are committed.
            self._commit(0, self.words + [w for w, _ in self._tentative], self._tentative,
                         decoded.language if decoded else self.language or "")
            return
        if self.options.language is None and self.gate.speech_s >= LANGUAGE_FIX_S \
                and (self.closing or self.language is None):
            self.language = decoded.language  # a final's, on a whole segment, prevails
        timed = said([(Word(w.word, w.start + self.offset_s, w.end + self.offset_s), t)
                      for w, t in zip(decoded.words, decoded.word_tokens, strict=True)],
                     self.gate.voiced_end / RATE, len(self.audio) / BYTES_PER_SAMPLE / RATE)
        if self.closing:  # the final follows at once; a partial may not correct the last one
            words = self.sealed + [w for w, _ in timed]
            self.hyp = Hypothesis(" ".join(w.word for w in words), tuple(words),
                                  decoded.language)
            self.partial = Hypothesis("", (), decoded.language)
            return
        new = past(self.words, timed, len(self.words) - self._kept)
        horizon = len(self.audio) / BYTES_PER_SAMPLE / RATE - self._engine.commit_margin_s
        words = self.words + [w for w, _ in new]
        eligible = sum(1 for w in words if w.end <= horizon)
        self._commit(self.agreement.update([w.word for w in words], eligible),
                     words, new, decoded.language)

    def _commit(self, agreed: int, words: list[Word], new: list[tuple[Word, list[int]]],
                language: str) -> None:
        """Commit the hypothesis ``words`` (the committed ones, then ``new``) up to
        ``agreed``, or further: a word older than ``commit_lag_s`` is shown even if two
        decodes did not agree on it (loops on repeated lines can keep them from agreeing
        for seconds), so partials never stall while speech flows. The final, a fresh
        decode, corrects it if it was wrong."""
        audio_s = len(self.audio) / BYTES_PER_SAMPLE / RATE
        overdue = audio_s - self._engine.commit_lag_s
        committed = max(agreed, len(self.words),
                        sum(1 for w in words if w.end <= overdue))
        self.agreement.committed = committed
        fresh = max(0, committed - len(self.words))
        self.words += [w for w, _ in new[:fresh]]
        self.tokens += [t for _, t in new[:fresh]]
        self._tentative = new[fresh:]
        self.hyp = Hypothesis(" ".join(w.word for w in words), tuple(words), language)
        self.partial = Hypothesis(" ".join(w.word for w in self.words), tuple(self.words),
                                  language)

    def finish(self) -> Hypothesis:
        if self.stale or not self.closing:
            # The step with the segment's last chunk decoded it for the final; a cut the
            # VAD found behind the cursor (max window), or a drain, did not: the final is
            # the same fresh decode of the whole segment, never the steps' partials.
            self.closing = True
            self._engine.decode_streams([self])
        hyp = self.hyp
        self.start()
        return hyp

    def close(self) -> None:
        self._engine.slots.give_back()


def past(committed: list[Word], window: list[tuple[Word, list[int]]], overlap: int = 0
         ) -> list[tuple[Word, list[int]]]:
    """The window's words that come after the committed ones: those that start after
    the last committed word's end (give or take the aligner's slack), less a head that
    says the committed tail again (the ``overlap`` committed words inside the window,
    re-decoded, or up to 5 words; compared loosely; whisper_streaming's rule)."""
    if not committed:
        return window
    after = committed[-1].end - WORD_OVERLAP_S
    new = [(w, t) for w, t in window if w.start >= after]
    for n in range(min(max(5, overlap), len(new), len(committed)), 0, -1):
        if [comparable(w.word) for w, _ in new[:n]] == \
                [comparable(w.word) for w in committed[-n:]]:
            return new[n:]
    return new


def quietest(voiced: list[bool], lo: int, hi: int) -> int | None:
    """The middle (a sample) of the longest run of unvoiced VAD frames between samples
    ``lo`` and ``hi``; None if none lasts ``PAUSE_FRAMES`` (a shorter one may be an
    unvoiced consonant inside a word)."""
    best: tuple[int, int] | None = None  # (frames, middle sample)
    run = 0
    first, last = lo // VAD_FRAME, min(len(voiced), hi // VAD_FRAME)
    for i in range(first, last + 1):
        if i < last and not voiced[i]:
            run += 1
            continue
        if run and (best is None or run > best[0]):
            best = (run, (i - run) * VAD_FRAME + run * VAD_FRAME // 2)
        run = 0
    return None if best is None or best[0] < PAUSE_FRAMES else best[1]


def said(words: list[tuple[Word, list[int]]], voiced_end_s: float, audio_end_s: float
         ) -> list[tuple[Word, list[int]]]:
    """The words without a trailing run placed after the last voiced audio: nobody said
    them. Whisper, given silence after the speech, sometimes says the segment's last
    sentence again; the aligner puts those words, each of no length, past the voice
    (measured on the shared recording: segment 2's repeat at 20.72 s, its voice ends at
    20.54 s). A step's window ends mid-speech: there the decoder's loops ("Yes. Yes.
    Yes.") are the words squeezed into its last 0.1 s."""
    limit = min(voiced_end_s, audio_end_s - VOICED_SLACK_S) + VOICED_SLACK_S
    cut = len(words)
    while cut and words[cut - 1][0].start > limit:
        cut -= 1
    return words[:cut]


class WhisperEngine:
    name = "whisper"
    sample_rate = ENGINE_SAMPLE_RATE

    def __init__(self, settings: Settings, *, slots: int) -> None:
        self.slots = Slots(slots, "whisper")
        self.model_dir = models.resolve(settings.whisper_model, settings.data_path)
        self.device = resolve_device(settings.device)
        self.compute_type = default_compute_type(self.device) \
            if settings.compute_type is ComputeType.AUTO else settings.compute_type.value
        self.cpu_threads = settings.cpu_threads or default_threads()
        self._fw = WhisperModel(str(self.model_dir), device=self.device,
                                compute_type=self.compute_type, cpu_threads=self.cpu_threads,
                                local_files_only=True)
        self.model: Any = self._fw.model
        self.multilingual = bool(self.model.is_multilingual)
        self._tokenizers: dict[tuple[str, Task], Tokenizer] = {}
        self.beam_size = max(1, settings.beam_size)
        self.batch_size = max(1, settings.whisper_batch_size)
        self.pad_samples = settings.whisper_pad_ms * RATE // 1000
        self.max_audio_samples = MAX_FRAMES * RATE // FRAMES_PER_S - self.pad_samples
        self.no_speech_threshold = settings.no_speech_threshold
        self.logprob_threshold = settings.logprob_threshold
        self.compression_ratio_threshold = settings.compression_ratio_threshold
        self.commit_margin_s = settings.whisper_commit_margin_ms / 1000
        self.lookback_s = settings.whisper_lookback_ms / 1000
        self.commit_lag_s = max(settings.whisper_commit_lag_ms,
                                settings.whisper_commit_margin_ms) / 1000
        self.lookback_samples = settings.whisper_lookback_ms * RATE // 1000
        self.step_window_samples = min(self.max_audio_samples,
                                       int(settings.whisper_step_window_s * RATE))
        self.tokens_per_s = settings.whisper_tokens_per_s
        self.min_speech_s = settings.min_speech_ms / 1000
        self.vad_aggressiveness = settings.vad_aggressiveness
        self._profile: StepProfile | None = None
        self._warm_up()

    def _warm_up(self) -> None:
        """One small decode at start, so that the first session does not pay for
        CTranslate2's first-call allocations."""
        self.decode([Job(np.zeros(RATE, dtype=np.float32), "en" if self.multilingual else None)])
        self._profile = None

    # --- slots ----------------------------------------------------------------------
    @property
    def slots_total(self) -> int:
        return self.slots.total

    def slots_free(self) -> int:
        return self.slots.free

    def open_stream(self, options: DecodeOptions = DEFAULT_OPTIONS) -> EngineStream:
        checked = self._checked(options)  # before the slot: a bad language takes none
        self.slots.take()
        return WhisperStream(self, checked)

    def _checked(self, options: DecodeOptions) -> DecodeOptions:
        if options.language is not None:
            self.tokenizer(options.language)  # an unknown language fails here, not mid-step
        return options

    # --- tokenizer ------------------------------------------------------------------
    def tokenizer(self, language: str | None, task: Task = Task.TRANSCRIBE) -> Tokenizer:
        """The tokenizer whose start sequence asks for ``language`` and ``task`` (an
        English-only model has neither token: it transcribes English)."""
        key = (language or "", task)
        tok = self._tokenizers.get(key)
        if tok is None:
            if language is not None and self.multilingual and \
                    language not in self._fw.supported_languages:
                raise ValueError(f"Whisper does not know language {language!r}")
            tok = Tokenizer(self._fw.hf_tokenizer, self.multilingual, task=task.value,
                            language=(language or "en") if self.multilingual else None)
            self._tokenizers[key] = tok
        return tok

    def _words_of(self, tokens: list[int]) -> list[str]:
        return str(self.tokenizer(None).decode(tokens)).split()

    @property
    def _eot(self) -> int:
        return int(self.tokenizer(None).eot)

    # --- realtime -------------------------------------------------------------------
    def step(self, work: Sequence[tuple[EngineStream, bytes]]) -> list[Hypothesis]:
        streams = [_as_whisper(stream) for stream, _ in work]
        for stream, (_, pcm) in zip(streams, work, strict=True):
            stream.append(pcm)
        self.decode_streams(streams)
        return [stream.partial for stream in streams]

    def decode_streams(self, streams: Sequence[WhisperStream]) -> None:
        """Re-decode each stream's window (or, its final, its segment); streams with too
        little speech get no text; a stream with a piece due decodes only that piece."""
        todo = [s for s in dict.fromkeys(streams) if s.ready()]
        for stream in streams:
            if stream not in todo:
                stream.take(None)
        self._profile = None
        if todo:
            pieces = [(s, job) for s in todo if (job := s.piece_job()) is not None]
            sealing = {s for s, _ in pieces}
            windows = [s for s in todo if s not in sealing]
            decoded = self.decode([job for _, job in pieces] + [s.job() for s in windows])
            for (stream, _), piece in zip(pieces, decoded, strict=False):
                stream.take_piece(piece)
            for stream, window in zip(windows, decoded[len(pieces):], strict=True):
                stream.take(window)

    # --- batch ----------------------------------------------------------------------
    def transcribe_batch(self, segments: Sequence[bytes],
                         options: DecodeOptions = DEFAULT_OPTIONS) -> list[Hypothesis]:
        """Segments in batches of ``whisper_batch_size``, each segment padded to its own
        ``BATCH_PAD_GRID_S`` grid and batched only with segments padded alike (so its words
        do not hang on what shares the call), shortest first, each decoded as text only
        (no timestamp tokens: on the shared recording's 25 s windows that decoded every
        word right, where the timestamped decode heard "the season" as "a season");
        results in the order given."""
        options = self._checked(options)
        for segment in segments:
            check_pcm(segment)
        language = options.language or ""
        out: list[Hypothesis] = [Hypothesis("", (), language)] * len(segments)
        gates = [self._gate(seg) for seg in segments]
        audio = [as_float(seg)[: self.max_audio_samples] for seg in segments]
        spoken = [i for i, gate in enumerate(gates) if gate.speech_s >= self.min_speech_s]
        for padded, batch in self._grid_batches(spoken, [len(a) for a in audio]):
            jobs = [Job(audio[i], options.language, [], options.prompt, options.temperature,
                        options.task, timestamps=False)
                    for i in batch]
            for index, job, decoded in zip(batch, jobs, self.decode(jobs, padded),
                                           strict=True):
                # the live lane's rule: a trailing run of words past the segment's last
                # voiced audio was not said (the shared recording's first 13 s segment
                # decoded alone ended "...incredulity. It was the epoch of incredulity.",
                # the repeat's words all at 13.02 s with no length, its voice ends 12.84 s)
                words = said(list(zip(decoded.words, decoded.word_tokens, strict=True)),
                             gates[index].voiced_end / RATE, len(job.audio) / RATE)
                out[index] = _hypothesis(Decoded(
                    decoded.tokens, [w for w, _ in words], [t for _, t in words],
                    decoded.language, decoded.no_speech or not words))
        return out

    def _grid_samples(self, samples: int) -> int:
        """What a batch-lane window of ``samples`` is padded to before it is encoded: the
        next multiple of ``BATCH_PAD_GRID_S`` (at most the longest audio), and the pad."""
        grid = BATCH_PAD_GRID_S * RATE
        return min(-(-samples // grid) * grid, self.max_audio_samples) + self.pad_samples

    def _grid_batches(self, indices: Sequence[int],
                      lengths: Sequence[int]) -> list[tuple[int, list[int]]]:
        """``indices`` in batches of at most ``batch_size``, each with the one length its
        members are padded to, shortest first."""
        alike: dict[int, list[int]] = {}
        for i in sorted(indices, key=lambda i: lengths[i]):
            alike.setdefault(self._grid_samples(lengths[i]), []).append(i)
        return [(padded, same[off : off + self.batch_size])
                for padded, same in sorted(alike.items())
                for off in range(0, len(same), self.batch_size)]

    def _gate(self, segment: bytes) -> SpeechGate:
        gate = SpeechGate(self.vad_aggressiveness)
        gate.push(segment)
        return gate

    # --- the batched CTranslate2 calls ------------------------------------------------
    def decode(self, jobs: Sequence[Job], padded: int | None = None) -> list[Decoded]:
        """Encode the jobs' audio together, each padded to ``padded`` samples (default: the
        longest and the pad), detect languages, generate, align words."""
        longest = padded or max(len(j.audio) for j in jobs) + self.pad_samples
        feats = np.stack([self._fw.feature_extractor(
            np.pad(j.audio, (0, longest - len(j.audio))), padding=0) for j in jobs])
        frames = min(MAX_FRAMES, feats.shape[2] // 2 * 2)
        feats = np.ascontiguousarray(feats[:, :, :frames])
        started = time.perf_counter()
        encoded = self.model.encode(ctranslate2.StorageView.from_array(feats),
                                    to_cpu=False)
        languages = self._languages(jobs, encoded)
        encode_s = time.perf_counter() - started
        prompts = [self._prompt(j, lang) for j, lang in zip(jobs, languages, strict=True)]
        results = self._generate(jobs, encoded, prompts)
        ts_begin = int(self.tokenizer(None).timestamp_begin)
        texts = [drop_repeats(r.sequences_ids[0], self._eot, ts_begin, len(j.audio) / RATE,
                              self._words_of)
                 for r, j in zip(results, jobs, strict=True)]
        words = self._align(encoded, texts, languages, [len(j.audio) for j in jobs],
                            jobs[0].task)
        decode_s = time.perf_counter() - started - encode_s
        self._profile = StepProfile(
            len(jobs), frames, encode_s,
            max(len(r.sequences_ids[0]) - len(p) for r, p in zip(results, prompts,
                                                                  strict=True)),
            decode_s)
        return [Decoded(text, [w for w, _ in ws], [t for _, t in ws], lang,
                        self._silent(r, text, lang))
                for r, text, ws, lang in zip(results, texts, words, languages, strict=True)]

    def _languages(self, jobs: Sequence[Job], encoded: Any) -> list[str]:
        if not self.multilingual:
            return ["en"] * len(jobs)
        if all(j.language for j in jobs):
            return [str(j.language) for j in jobs]
        detected = self.model.detect_language(encoded)
        return [j.language or str(found[0][0])[2:-2]
                for j, found in zip(jobs, detected, strict=True)]

    def _prompt(self, job: Job, language: str) -> list[int]:
        tok = self.tokenizer(language, job.task)
        prompt: list[int] = []
        if job.prompt:
            prompt += [tok.sot_prev, *tok.encode(" " + job.prompt.strip())[-PROMPT_TOKENS:]]
        prompt += list(tok.sot_sequence)
        if not job.timestamps:
            prompt.append(tok.no_timestamps)
        elif job.prefix:
            prompt += [tok.timestamp_begin, *job.prefix]
        return prompt

    def _generate(self, jobs: Sequence[Job], encoded: Any, prompts: list[list[int]]) -> Any:
        audio_s = max(len(j.audio) for j in jobs) / RATE
        budget = BASE_TOKENS + int(self.tokens_per_s * audio_s)
        # Measured: with timestamps, CTranslate2 stops at about half of max_length.
        max_length = min(448, max(len(p) for p in prompts) + 2 * budget)
        temperature = max(j.temperature for j in jobs)
        sampling: dict[str, Any] = {}
        if temperature > 0:
            sampling = {"sampling_topk": 0, "sampling_temperature": temperature}
        return self.model.generate(
            encoded, prompts, beam_size=1 if temperature > 0 else self.beam_size,
            max_length=max_length, return_scores=True, return_no_speech_prob=True,
            suppress_blank=True, suppress_tokens=[-1], **sampling)

    def _silent(self, result: Any, text: list[int], language: str) -> bool:
        """No text, or text the model itself does not believe: a loop (text that
        compresses too well), improbable tokens (noise decodes at an average
        log-probability near -2, speech above -0.5 here), or a high no-speech
        probability with doubtful tokens."""
        if not text:
            return True
        generated = self.tokenizer(language).decode(result.sequences_ids[0])  # repeats too
        if compression_ratio(generated) > self.compression_ratio_threshold:
            return True
        logprob = float(result.scores[0]) if result.scores else 0.0
        return bool(logprob < self.logprob_threshold
                    or (result.no_speech_prob > self.no_speech_threshold
                        and logprob < self.logprob_threshold / 2))

    def _align(self, encoded: Any, texts: list[list[int]], languages: list[str],
               samples: list[int], task: Task) -> list[list[tuple[Word, list[int]]]]:
        """Each sequence's words, timed, with their tokens."""
        if not any(texts):
            return [[] for _ in texts]
        # One start sequence serves the batch (the aligner takes one); the language
        # and task tokens barely move the cross-attention the timings come from.
        tok = self.tokenizer(languages[0], task)
        num_frames = [max(1, n * FRAMES_PER_S // RATE) for n in samples]
        aligned = self._fw.find_alignment(tok, [t or [tok.eot] for t in texts], encoded,
                                          num_frames)
        out: list[list[tuple[Word, list[int]]]] = []
        for text, alignment in zip(texts, aligned, strict=True):
            if not text:
                out.append([])
                continue
            merge_punctuations(alignment, PREPEND_PUNCTUATION, APPEND_PUNCTUATION)
            out.append([(Word(a["word"].strip(), round(float(a["start"]), 3),
                              round(float(a["end"]), 3)), list(a["tokens"]))
                        for a in alignment if a["word"].strip()])
        return out

    # --- cost -----------------------------------------------------------------------
    def cost_prior(self) -> CostPrior:
        scale = 1.0 / max(1, self.cpu_threads) if self.device == "cpu" else 0.1
        return CostPrior(0.0, PRIOR_FIXED_S, 0.0, redecodes=True,
                         frame_s=PRIOR_FRAME_S * scale, frame2_s=PRIOR_FRAME2_S * scale,
                         token_s=PRIOR_TOKEN_S * scale, tokens_per_step=PRIOR_TOKENS_PER_STEP,
                         pad_frames=self.pad_samples * FRAMES_PER_S // RATE)

    def last_profile(self) -> StepProfile | None:
        return self._profile


def _hypothesis(decoded: Decoded) -> Hypothesis:
    if decoded.no_speech:
        return Hypothesis("", (), decoded.language)
    return Hypothesis(" ".join(w.word for w in decoded.words), tuple(decoded.words),
                      decoded.language)


def _as_whisper(stream: EngineStream) -> WhisperStream:
    if not isinstance(stream, WhisperStream):
        raise TypeError(f"not a whisper stream: {type(stream).__name__}")
    return stream
