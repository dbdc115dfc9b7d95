"""A batch job's audio blob: reading it, VAD-segmenting it and placing each
segment's hypothesis back on the job's timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.base import Hypothesis
from lanegate.blobs import BlobError, BlobStore
from lanegate.constants import ENGINE_SAMPLE_RATE, SAMPLE_WIDTH
from lanegate.transcript import Segment, Word
from vad import SegmentEnded, StreamingSegmenter, VadError, VadSettings

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


def read_segment(path: Path, seg: SegmentEnded) -> bytes:
    with path.open("rb") as f:
        f.seek(seg.start * SAMPLE_WIDTH)
        return f.read(seg.length * SAMPLE_WIDTH)


def to_segment(seg: SegmentEnded, hyp: Hypothesis) -> Segment:
    offset = seg.start / ENGINE_SAMPLE_RATE
    words = tuple(Word(w.word, round(w.start + offset, 3), round(w.end + offset, 3))
                  for w in hyp.words)
    return Segment(start=round(offset, 3), end=round(seg.end / ENGINE_SAMPLE_RATE, 3),
                   text=hyp.text.strip(), words=words, cut=seg.reason)
