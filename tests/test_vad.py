"""VAD segmenter: properties on generated signals, real espeak-ng speech, bad input."""

from __future__ import annotations

import random
import subprocess
import tracemalloc
import wave
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import soxr
import webrtcvad
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lanegate.settings import Settings
from vad import (
    SEGMENT_REASONS,
    SegmentEnded,
    SpeechStarted,
    StreamingSegmenter,
    VadError,
    VadEvent,
    VadSettings,
    segment_pcm,
)

Pcm = npt.NDArray[np.int16]
RATE = 16000


# --------------------------------------------------------------------------- helpers


def run_chunked(pcm: bytes, vs: VadSettings, chunk_samples: Sequence[int]) -> list[VadEvent]:
    """Feed ``pcm`` in the given chunk sizes (cycled); check earliest_needed and settled
    on the way: no later event starts before the first, no later endpoint cut ends
    before the second, which never passes the audio pushed."""
    seg = StreamingSegmenter(vs)
    events: list[VadEvent] = []
    floors: list[tuple[int, int, int]] = []  # (events seen, earliest_needed, settled)
    off, i = 0, 0
    while off < len(pcm):
        n = 2 * max(1, chunk_samples[i % len(chunk_samples)])
        events += seg.push(pcm[off : off + n])
        off += n
        i += 1
        assert seg.position == min(off, len(pcm)) // 2
        assert seg.settled <= seg.position
        floors.append((len(events), seg.earliest_needed, seg.settled))
    events += seg.flush()
    for seen, floor, settled in floors:
        for e in events[seen:]:
            assert e.start >= floor, (e, floor)
            if isinstance(e, SegmentEnded) and e.reason == "endpoint":
                assert e.end > settled, (e, settled)
    return events


def segments_of(events: Sequence[VadEvent]) -> list[SegmentEnded]:
    return [e for e in events if isinstance(e, SegmentEnded)]


def check_invariants(events: Sequence[VadEvent], n_samples: int, vs: VadSettings) -> None:
    window = round(vs.max_window_s * vs.sample_rate)
    open_start: int | None = None
    prev: SegmentEnded | None = None
    for e in events:
        if isinstance(e, SpeechStarted):
            assert open_start is None, "two SpeechStarted without a SegmentEnded"
            open_start = e.start
            continue
        assert open_start == e.start, "SegmentEnded does not close the open segment"
        open_start = None
        assert e.reason in SEGMENT_REASONS
        assert 0 <= e.start < e.end <= n_samples
        assert e.end - e.start <= window
        if prev is not None:
            assert prev.end <= e.start, "segments overlap or are out of order"
            if prev.reason == "max_window":
                assert e.start == prev.end, "audio lost or duplicated at a soft cut"
        prev = e
    assert open_start is None, "flush() left a segment open"
    if prev is not None:
        assert prev.reason != "max_window", "a soft cut's remainder was never closed"


def pre_emphasis_energy(x: Pcm, frame: int) -> npt.NDArray[np.int64]:
    """The segmenter's short-time energy, computed independently here."""
    n = len(x) // frame
    f = x[: n * frame].astype(np.int64).reshape(n, frame)
    d = np.diff(f, axis=1)
    return (d * d).sum(axis=1)


def check_soft_cuts(segs: Sequence[SegmentEnded], x: Pcm, vs: VadSettings) -> None:
    """Every soft cut sits in the quietest frame (scored with its two neighbours)."""
    frame = vs.sample_rate * vs.frame_ms // 1000
    energy = pre_emphasis_energy(x, frame)
    window = round(vs.max_window_s * vs.sample_rate)
    search = round(vs.soft_cut_search_s * vs.sample_rate)
    for s in segs:
        if s.reason != "max_window":
            continue
        window_end = s.start + window
        first = -(-(window_end - search) // frame)
        last = window_end // frame - 2
        assert first <= last
        score = {f: int(energy[f - 1] + energy[f] + energy[f + 1]) for f in range(first, last + 1)}
        cut_frame = s.end // frame
        assert cut_frame in score, "soft cut outside its search range"
        assert score[cut_frame] == min(score.values()), "soft cut not at the quietest frame"


def vad_speech_frames(x: Pcm, vs: VadSettings) -> list[int]:
    vad = webrtcvad.Vad(vs.aggressiveness)
    frame = vs.sample_rate * vs.frame_ms // 1000
    raw = x.tobytes()
    return [
        f
        for f in range(len(x) // frame)
        if vad.is_speech(raw[2 * f * frame : 2 * (f + 1) * frame], vs.sample_rate)
    ]


def covered(sample_range: tuple[int, int], segs: Sequence[SegmentEnded]) -> bool:
    """Whether the union of the segments (a soft cut joins two) holds the range."""
    merged: list[list[int]] = []
    for seg in segs:
        if merged and merged[-1][1] == seg.start:
            merged[-1][1] = seg.end
        else:
            merged.append([seg.start, seg.end])
    a, b = sample_range
    return any(lo <= a and b <= hi for lo, hi in merged)


# ------------------------------------------------------------ generated signals


@dataclass(frozen=True)
class Block:
    kind: str  # "silence", "hiss" or "voiced"
    ms: int
    level: int
    seed: int


def render(blocks: Sequence[Block], rate: int = RATE) -> Pcm:
    parts: list[npt.NDArray[np.float64]] = []
    for b in blocks:
        n = rate * b.ms // 1000
        rng = np.random.default_rng(b.seed)
        if b.kind == "silence":
            parts.append(np.zeros(n))
        elif b.kind == "hiss":
            parts.append(rng.standard_normal(n) * b.level / 20)
        else:  # a buzzy vowel-like sound with a syllable-rate envelope
            t = np.arange(n) / rate
            f0 = 90 + rng.uniform(0, 160)
            tone = sum(np.sin(2 * np.pi * f0 * k * t) / k for k in range(1, 12))
            env = 0.55 + 0.45 * np.sin(2 * np.pi * rng.uniform(2, 6) * t)
            parts.append(tone * env * b.level + rng.standard_normal(n) * b.level / 30)
    x = np.concatenate(parts) if parts else np.zeros(0)
    return np.clip(x, -32768, 32767).astype(np.int16)


blocks_st = st.lists(
    st.builds(
        Block,
        kind=st.sampled_from(["silence", "hiss", "voiced", "voiced"]),
        ms=st.integers(10, 3000),
        level=st.integers(200, 9000),
        seed=st.integers(0, 2**31),
    ),
    min_size=1,
    max_size=10,
)


@st.composite
def vad_settings_st(
    draw: st.DrawFn, rate: int = RATE, small_min_speech: bool = False
) -> VadSettings:
    frame_ms = draw(st.sampled_from([10, 20, 30]))
    window_ms = draw(st.integers(8 * frame_ms, 4000))
    search_ms = draw(st.integers(4 * frame_ms, window_ms - 2 * frame_ms))
    room = window_ms - search_ms - 1  # pad + min_speech must fit before the search range
    min_speech_ms = draw(st.integers(0, min(room, frame_ms if small_min_speech else 400)))
    return VadSettings(
        sample_rate=rate,
        frame_ms=frame_ms,
        aggressiveness=draw(st.integers(0, 3)),
        endpoint_silence_ms=draw(st.integers(frame_ms, 900)),
        pad_ms=draw(st.integers(0, min(300, room - min_speech_ms))),
        min_speech_ms=min_speech_ms,
        max_window_s=window_ms / 1000,
        soft_cut_search_s=search_ms / 1000,
    )


chunks_st = st.lists(st.integers(1, 5000), min_size=1, max_size=8)
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(blocks=blocks_st, vs=vad_settings_st(), chunks=chunks_st)
def test_segments_are_ordered_bounded_and_chunking_proof(
    blocks: list[Block], vs: VadSettings, chunks: list[int]
) -> None:
    x = render(blocks)
    whole = StreamingSegmenter(vs)
    at_once = whole.push(x.tobytes()) + whole.flush()
    check_invariants(at_once, len(x), vs)
    check_soft_cuts(segments_of(at_once), x, vs)
    assert run_chunked(x.tobytes(), vs, chunks) == at_once
    assert segment_pcm(x.tobytes(), vs) == segments_of(at_once)


@PROPERTY
@given(blocks=blocks_st, vs=vad_settings_st(small_min_speech=True))
def test_every_speech_frame_is_inside_a_segment(blocks: list[Block], vs: VadSettings) -> None:
    x = render(blocks)
    segs = segment_pcm(x.tobytes(), vs)
    frame = vs.sample_rate * vs.frame_ms // 1000
    for f in vad_speech_frames(x, vs):
        assert covered((f * frame, (f + 1) * frame), segs), f"speech frame {f} dropped"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    blocks=st.lists(
        st.builds(
            Block,
            kind=st.sampled_from(["silence", "voiced"]),
            ms=st.integers(50, 2500),
            level=st.integers(1000, 9000),
            seed=st.integers(0, 2**31),
        ),
        min_size=1,
        max_size=6,
    ),
    rate=st.sampled_from([8000, 11025, 22050, 44100, 48000, 24000]),
    chunks=chunks_st,
    data=st.data(),
)
def test_any_sample_rate_is_chunking_proof(
    blocks: list[Block], rate: int, chunks: list[int], data: st.DataObject
) -> None:
    vs = data.draw(vad_settings_st(rate=rate))
    x = render(blocks, rate)
    at_once = run_chunked(x.tobytes(), vs, [len(x) + 1])
    check_invariants(at_once, len(x), vs)
    assert run_chunked(x.tobytes(), vs, chunks) == at_once


# ------------------------------------------------------------------- real speech

SENTENCES = [
    "The meeting will start at nine tomorrow morning",
    "Please send the quarterly report to the finance team",
    "Our new product ships to customers next week",
    "Thank you all for joining the call today",
]
WORD_TEXT = (
    "the quick fox jumps over lazy dog meeting budget quarter revenue customer project "
    "team schedule review design system network service release version product market "
    "strategy growth planning support question answer people number important morning "
    "afternoon brown"
)
WORDS = WORD_TEXT.split()
NOISE_SECONDS = 240


def read_pcm(path: Path) -> tuple[bytes, int]:
    with wave.open(str(path)) as w:
        return w.readframes(w.getnframes()), w.getframerate()


def trimmed(path: Path, threshold: int = 200) -> Pcm:
    """The speech in a WAV without espeak's leading and trailing silence."""
    pcm, rate = read_pcm(path)
    assert rate == RATE
    x = np.frombuffer(pcm, dtype=np.int16)
    loud = np.flatnonzero(np.abs(x.astype(np.int32)) > threshold)
    return x[loud[0] : loud[-1] + 1]


@dataclass(frozen=True)
class Speech:
    pcm: Pcm
    spans: list[tuple[int, int]]  # [start, end) of each sentence or word, in samples


@pytest.fixture(scope="session")
def paused_sentences(speech: Callable[..., Path], brown_noise: Pcm) -> Speech:
    """Sentences between 1 s pauses, over a quiet room tone (brown noise at -52 dBFS)."""
    pause = np.zeros(RATE, dtype=np.int16)
    parts: list[Pcm] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for text in SENTENCES:
        s = trimmed(speech(text))
        parts += [pause, s]
        spans.append((pos + len(pause), pos + len(pause) + len(s)))
        pos += len(pause) + len(s)
    parts.append(pause)
    x = np.concatenate(parts)
    tone = brown_noise[: len(x)].astype(np.int32) // 20
    return Speech(np.clip(x + tone, -32768, 32767).astype(np.int16), spans)


@pytest.fixture(scope="session")
def unpaused_speech(speech: Callable[..., Path]) -> Speech:
    """Four minutes of words with only 60-120 ms junctures: never a breath."""
    words = {w: trimmed(speech(w)) for w in WORDS}
    rng = random.Random(3)
    parts: list[Pcm] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    while pos < NOISE_SECONDS * RATE:
        w = words[rng.choice(WORDS)]
        gap = np.zeros(int(RATE * rng.uniform(0.06, 0.12)), dtype=np.int16)
        parts += [w, gap]
        spans.append((pos, pos + len(w)))
        pos += len(w) + len(gap)
    return Speech(np.concatenate(parts)[: NOISE_SECONDS * RATE], spans)


@pytest.fixture(scope="session")
def brown_noise(speech_dir: Path) -> Pcm:
    path = speech_dir / "brown_noise.wav"
    if not path.exists():
        subprocess.run(
            [
                "sox",
                "-R",
                "-n",
                "-r",
                str(RATE),
                "-c",
                "1",
                "-b",
                "16",
                str(path),
                "synth",
                str(NOISE_SECONDS),
                "brownnoise",
                "vol",
                "0.1",
            ],
            check=True,
            capture_output=True,
        )
    pcm, _ = read_pcm(path)
    return np.frombuffer(pcm, dtype=np.int16)


def test_sentences_split_at_the_pauses(paused_sentences: Speech) -> None:
    vs = VadSettings()
    x = paused_sentences.pcm
    events = run_chunked(x.tobytes(), vs, [320])  # 20 ms chunks, as a live stream
    check_invariants(events, len(x), vs)
    segs = segments_of(events)
    assert [s.reason for s in segs] == ["endpoint"] * len(SENTENCES)
    pad = vs.pad_ms * RATE // 1000
    tolerance = RATE * 200 // 1000
    for seg, (start, end) in zip(segs, paused_sentences.spans, strict=True):
        assert abs(seg.start + pad - start) <= tolerance, (seg, start)
        assert abs(seg.end - pad - end) <= tolerance, (seg, end)
    assert segment_pcm(x.tobytes(), vs) == segs


@pytest.mark.parametrize("rate", [8000, 44100])
def test_sentences_split_the_same_at_other_rates(paused_sentences: Speech, rate: int) -> None:
    y = soxr.resample(paused_sentences.pcm, RATE, rate).astype(np.int16)
    segs = segment_pcm(y.tobytes(), VadSettings(sample_rate=rate))
    check_invariants(segs_with_starts(segs), len(y), VadSettings(sample_rate=rate))
    assert len(segs) == len(SENTENCES)
    pad = 200 * rate // 1000
    tolerance = rate * 200 // 1000
    for seg, (start, end) in zip(segs, paused_sentences.spans, strict=True):
        assert abs(seg.start + pad - start * rate // RATE) <= tolerance
        assert abs(seg.end - pad - end * rate // RATE) <= tolerance


def segs_with_starts(segs: Sequence[SegmentEnded]) -> list[VadEvent]:
    out: list[VadEvent] = []
    for s in segs:
        out += [SpeechStarted(s.start), s]
    return out


def check_long_speech_cuts(x: Pcm, spans: Sequence[tuple[int, int]]) -> None:
    vs = VadSettings()
    events = run_chunked(x.tobytes(), vs, [1600])  # 100 ms chunks
    check_invariants(events, len(x), vs)
    segs = segments_of(events)
    assert all(s.reason == "max_window" for s in segs[:-1])
    assert segs[-1].reason == "end"
    assert len(segs) >= NOISE_SECONDS // 25
    assert segs[0].start <= RATE // 2
    assert segs[-1].end == len(x)
    check_soft_cuts(segs, x, vs)
    starts = np.array([a for a, _ in spans])
    slack = RATE * 50 // 1000  # word edges carry faint decay tails
    for s in segs[:-1]:
        i = int(np.searchsorted(starts, s.end, side="right")) - 1
        a, b = spans[i]
        assert not (a + slack < s.end < b - slack), (
            f"cut at {s.end / RATE:.3f}s is inside the word {a / RATE:.3f}-{b / RATE:.3f}s"
        )


def test_unpaused_speech_is_cut_between_words(unpaused_speech: Speech) -> None:
    check_long_speech_cuts(unpaused_speech.pcm, unpaused_speech.spans)


def test_brown_noise_defeats_the_endpointer(brown_noise: Pcm) -> None:
    segs = segment_pcm(brown_noise.tobytes())
    assert "endpoint" not in [s.reason for s in segs]
    assert sum(s.end - s.start for s in segs) >= 0.95 * len(brown_noise)


def test_unpaused_speech_under_brown_noise_is_cut_between_words(
    unpaused_speech: Speech, brown_noise: Pcm
) -> None:
    mixed = unpaused_speech.pcm.astype(np.int32) + brown_noise[: len(unpaused_speech.pcm)]
    x = np.clip(mixed, -32768, 32767).astype(np.int16)
    check_long_speech_cuts(x, unpaused_speech.spans)


def test_memory_stays_bounded_on_endless_speech(unpaused_speech: Speech, brown_noise: Pcm) -> None:
    """Ten minutes of speech that never pauses, pushed in 100 ms chunks."""
    x = np.clip(unpaused_speech.pcm.astype(np.int32) + brown_noise, -32768, 32767)
    chunk = x[: 60 * RATE].astype(np.int16).tobytes()  # one minute, pushed ten times
    seg = StreamingSegmenter()
    step = RATE // 10 * 2
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for _ in range(10):
            for off in range(0, len(chunk), step):
                seg.push(chunk[off : off + step])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    window_bytes = 25 * RATE * 2
    assert peak - base < window_bytes, f"grew {(peak - base) / 1e6:.1f} MB over ten minutes"
    assert seg.position == 10 * 60 * RATE
    assert seg.position - seg.earliest_needed <= 25 * RATE


# --------------------------------------------------------------------- bad input


def test_odd_byte_count_is_rejected() -> None:
    seg = StreamingSegmenter()
    with pytest.raises(VadError, match="odd byte count"):
        seg.push(b"\x00\x01\x02")
    with pytest.raises(VadError, match="odd byte count"):
        segment_pcm(b"\x00" * 321)


def test_empty_push_returns_nothing() -> None:
    seg = StreamingSegmenter()
    assert seg.push(b"") == []
    assert seg.position == 0
    assert seg.flush() == []
    assert segment_pcm(b"") == []


def test_push_after_flush_is_rejected() -> None:
    seg = StreamingSegmenter()
    seg.flush()
    with pytest.raises(VadError, match="after flush"):
        seg.push(b"\x00\x00")


@pytest.mark.parametrize("rate", [0, 4000, 7999, 48001, 96000])
def test_unsupported_sample_rate_is_rejected(rate: int) -> None:
    with pytest.raises(VadError, match="sample rate"):
        VadSettings(sample_rate=rate)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"frame_ms": 25}, "frame_ms"),
        ({"aggressiveness": 4}, "aggressiveness"),
        ({"aggressiveness": -1}, "aggressiveness"),
        ({"endpoint_silence_ms": 5}, "endpoint_silence_ms"),
        ({"pad_ms": -1}, "pad_ms"),
        ({"max_window_s": 0.05}, "max_window_s"),
        ({"soft_cut_search_s": 0.01}, "soft_cut_search_s"),
        ({"soft_cut_search_s": 30.0}, "soft_cut_search_s"),
        ({"max_window_s": 1.0, "soft_cut_search_s": 0.6, "pad_ms": 300}, "pad_ms"),
    ],
)
def test_bad_settings_are_rejected(change: dict[str, float], message: str) -> None:
    with pytest.raises(VadError, match=message):
        VadSettings(**change)  # type: ignore[arg-type]


def test_vad_settings_come_from_the_service_settings() -> None:
    s = Settings().replace(vad_aggressiveness=3, max_window_s=12.0, pad_ms=100)
    vs = VadSettings.from_settings(s, sample_rate=8000)
    assert (vs.aggressiveness, vs.max_window_s, vs.pad_ms, vs.sample_rate) == (3, 12.0, 100, 8000)
    assert vs.endpoint_silence_ms == s.endpoint_silence_ms


def test_a_cut_ends_the_open_segment_and_the_segmenter_listens_on(
        paused_sentences: Speech) -> None:
    """A commit in the middle of the first sentence: that segment ends there (reason
    "commit"), the rest of the sentence opens a new one, the later ones are unchanged."""
    x = paused_sentences.pcm.tobytes()
    start, end = paused_sentences.spans[0]
    middle = (start + end) // 2
    seg = StreamingSegmenter(VadSettings())
    events = seg.push(x[: middle * 2])
    events += seg.cut()
    assert seg.cut() == []  # nothing open any more
    events += seg.push(x[middle * 2:]) + seg.flush()
    segs = segments_of(events)
    assert segs[0].reason == "commit"
    assert segs[0].end <= middle < segs[1].start + VadSettings().frame_ms * RATE // 1000
    whole = segment_pcm(x, VadSettings())
    assert segs[2:] == whole[1:]
