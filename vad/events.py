"""Events a segmenter emits; sample indexes are at the caller's sample rate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: "commit": the caller ended the segment (``StreamingSegmenter.cut``)
SegmentReason = Literal["endpoint", "max_window", "end", "commit"]
SEGMENT_REASONS: tuple[SegmentReason, ...] = ("endpoint", "max_window", "end", "commit")


@dataclass(frozen=True)
class SpeechStarted:
    """A segment is open from ``start`` (padding included)."""

    start: int


@dataclass(frozen=True)
class SegmentEnded:
    """The segment ``[start, end)`` is closed for ``reason``."""

    start: int
    end: int
    reason: SegmentReason

    @property
    def length(self) -> int:
        return self.end - self.start


VadEvent = SpeechStarted | SegmentEnded
