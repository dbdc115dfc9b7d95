"""Decode windows: consecutive VAD segments joined into one span of audio for a
decoder that hears up to 30 s at a time (pure: no I/O).

The batch lane decodes windows, not sentences: Whisper given a sentence alone loses
the words around it ("spring" heard as "string" in the shared recording), and given
about 25 s of consecutive speech it does not (``docs/ARCHITECTURE.md``, Batch lane).
A window's text is then placed back on its segments (``lanes.job_audio``), so a
transcript's cues stay one per VAD segment."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vad.events import SegmentEnded, SegmentReason


@dataclass(frozen=True)
class Window:
    """Consecutive segments decoded as one: ``[start, end)`` holds them and the pauses
    between them."""

    parts: tuple[SegmentEnded, ...]

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a window holds at least one segment")

    @property
    def start(self) -> int:
        return self.parts[0].start

    @property
    def end(self) -> int:
        return self.parts[-1].end

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def reason(self) -> SegmentReason:
        return self.parts[-1].reason


def decode_windows(segments: Sequence[SegmentEnded], max_samples: int) -> list[Window]:
    """``segments`` joined greedily, in order, while a window stays at most
    ``max_samples`` long from its first start to its last end; a segment longer than
    that on its own is a window of its own. ``max_samples <= 0``: one window per
    segment. Raises ValueError for segments out of order or overlapping."""
    out: list[list[SegmentEnded]] = []
    for seg in segments:
        if seg.end < seg.start or (out and seg.start < out[-1][-1].end):
            raise ValueError(f"segments must be ordered and not overlap: "
                             f"[{seg.start}, {seg.end})")
        if out and max_samples > 0 and seg.end - out[-1][0].start <= max_samples:
            out[-1].append(seg)
        else:
            out.append([seg])
    return [Window(tuple(parts)) for parts in out]
