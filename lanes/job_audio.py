"""A batch job's audio blob: reading it, VAD-segmenting it into decode windows and
placing each window's hypothesis back on the job's timeline, one cue per VAD segment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.base import Hypothesis
from lanegate.blobs import BlobError, BlobStore
from lanegate.constants import ENGINE_SAMPLE_RATE, SAMPLE_WIDTH
from lanegate.transcript import Segment, Word
from vad import (
    SegmentEnded,
    StreamingSegmenter,
    VadError,
    VadSettings,
    Window,
    decode_windows,
    segment_pcm,
)

#: VAD reads the audio file in pieces this long
READ_CHUNK_S = 10


class PoisonAudio(ValueError):
    """A job's audio cannot be processed; retrying will not help."""


def audio_path(blobs: BlobStore, job_id: str) -> Path:
    """Where the job's PCM lives (without creating anything)."""
    try:
        return blobs.dir(job_id) / "audio.pcm"
    except BlobError as exc:
        raise PoisonAudio(str(exc)) from exc


def load_segments(path: Path, vad: VadSettings) -> tuple[list[SegmentEnded], int]:
    """VAD segments of a PCM blob and its length in samples; raises PoisonAudio."""
    if not path.is_file():
        raise PoisonAudio("audio blob is missing")
    size = path.stat().st_size
    if size == 0:
        raise PoisonAudio("audio blob is empty")
    if size % SAMPLE_WIDTH:
        raise PoisonAudio(f"corrupt audio blob: {size} bytes is not whole 16-bit samples")
    segmenter = StreamingSegmenter(vad)
    events: list[Any] = []
    try:
        with path.open("rb") as f:
            while chunk := f.read(READ_CHUNK_S * ENGINE_SAMPLE_RATE * SAMPLE_WIDTH):
                events += segmenter.push(chunk)
        events += segmenter.flush()
    except (OSError, VadError) as exc:
        raise PoisonAudio(f"unreadable audio blob: {exc}") from exc
    return [e for e in events if isinstance(e, SegmentEnded)], size // SAMPLE_WIDTH


def load_windows(path: Path, vad: VadSettings, window_s: float
                 ) -> tuple[list[Window], int]:
    """``load_segments``, the segments joined into decode windows of at most
    ``window_s`` (0: one per segment)."""
    segments, samples = load_segments(path, vad)
    return decode_windows(segments, round(window_s * ENGINE_SAMPLE_RATE)), samples


def pcm_windows(pcm: bytes, vad: VadSettings, window_s: float) -> list[bytes]:
    """The batch lane's decode windows of a buffer in memory (16 kHz s16le), as audio:
    what a job of this audio hands its engine (offline comparisons use it)."""
    windows = decode_windows(segment_pcm(pcm, vad), round(window_s * ENGINE_SAMPLE_RATE))
    return [pcm[w.start * SAMPLE_WIDTH : w.end * SAMPLE_WIDTH] for w in windows]


def read_segment(path: Path, seg: SegmentEnded | Window) -> bytes:
    with path.open("rb") as f:
        f.seek(seg.start * SAMPLE_WIDTH)
        return f.read(seg.length * SAMPLE_WIDTH)


def to_cues(window: Window, hyp: Hypothesis) -> tuple[Segment, ...]:
    """The window's hypothesis as one cue per VAD segment in it: each word goes to the
    segment its middle falls in (a pause between two segments is split at its middle).
    A window of one segment, or a hypothesis without word times, is one cue."""
    offset = window.start / ENGINE_SAMPLE_RATE
    words = [Word(w.word, round(w.start + offset, 3), round(w.end + offset, 3))
             for w in hyp.words]
    if len(window.parts) == 1 or not words:
        return (Segment(start=round(offset, 3), end=round(window.end / ENGINE_SAMPLE_RATE, 3),
                        text=hyp.text.strip(), words=tuple(words), cut=window.reason),)
    # words that spell the text with their own spaces are kept so; others (Whisper's here
    # arrive stripped) are joined with one space
    spelled = "".join(w.word for w in words).strip() == hyp.text.strip()
    bounds = [(a.end + b.start) / 2 / ENGINE_SAMPLE_RATE
              for a, b in zip(window.parts, window.parts[1:], strict=False)]
    placed: list[list[Word]] = [[] for _ in window.parts]
    for word in words:
        middle = (word.start + word.end) / 2
        placed[sum(middle >= b for b in bounds)].append(word)
    return tuple(
        Segment(start=round(part.start / ENGINE_SAMPLE_RATE, 3),
                end=round(part.end / ENGINE_SAMPLE_RATE, 3),
                text=("".join(w.word for w in mine) if spelled
                      else " ".join(w.word.strip() for w in mine)).strip(),
                words=tuple(mine), cut=part.reason)
        for part, mine in zip(window.parts, placed, strict=True))
