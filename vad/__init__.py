"""Voice activity detection and speech segmentation shared by both lanes."""

from vad.errors import VadError
from vad.events import SEGMENT_REASONS, SegmentEnded, SegmentReason, SpeechStarted, VadEvent
from vad.segmenter import StreamingSegmenter, segment_pcm
from vad.settings import VadSettings
from vad.windows import Window, decode_windows

__all__ = [
    "SEGMENT_REASONS",
    "SegmentEnded",
    "SegmentReason",
    "SpeechStarted",
    "StreamingSegmenter",
    "VadError",
    "VadEvent",
    "VadSettings",
    "Window",
    "decode_windows",
    "segment_pcm",
]
