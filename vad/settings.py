"""VAD settings and their validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vad.errors import VadError

if TYPE_CHECKING:
    from lanegate.settings import Settings

MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 48000
WEBRTC_RATES = (8000, 16000, 32000, 48000)
FRAME_MS_CHOICES = (10, 20, 30)
# Rates webrtcvad lacks are resampled to this one (cheapest rate that keeps speech bands).
RESAMPLE_RATE = 16000


@dataclass(frozen=True)
class VadSettings:
    sample_rate: int = 16000
    frame_ms: int = 30
    aggressiveness: int = 2
    endpoint_silence_ms: int = 600
    pad_ms: int = 200
    min_speech_ms: int = 150
    max_window_s: float = 25.0
    soft_cut_search_s: float = 3.0

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_settings(cls, settings: Settings, sample_rate: int = 16000) -> VadSettings:
        """The VAD part of the service-wide settings object."""
        return cls(
            sample_rate=sample_rate,
            frame_ms=settings.vad_frame_ms,
            aggressiveness=settings.vad_aggressiveness,
            endpoint_silence_ms=settings.endpoint_silence_ms,
            pad_ms=settings.pad_ms,
            min_speech_ms=settings.min_speech_ms,
            max_window_s=settings.max_window_s,
            soft_cut_search_s=settings.soft_cut_search_s,
        )

    @property
    def vad_rate(self) -> int:
        """The rate frames are classified at."""
        return self.sample_rate if self.sample_rate in WEBRTC_RATES else RESAMPLE_RATE


def validate(s: VadSettings) -> None:
    if not isinstance(s.sample_rate, int) or not (
        MIN_SAMPLE_RATE <= s.sample_rate <= MAX_SAMPLE_RATE
    ):
        raise VadError(
            f"unsupported sample rate {s.sample_rate!r}: "
            f"need an integer from {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz"
        )
    if s.frame_ms not in FRAME_MS_CHOICES:
        raise VadError(f"frame_ms must be one of {FRAME_MS_CHOICES}, got {s.frame_ms!r}")
    if s.aggressiveness not in (0, 1, 2, 3):
        raise VadError(f"aggressiveness must be 0, 1, 2 or 3, got {s.aggressiveness!r}")
    if s.endpoint_silence_ms < s.frame_ms:
        raise VadError(
            f"endpoint_silence_ms ({s.endpoint_silence_ms}) must be at least "
            f"one frame ({s.frame_ms} ms)"
        )
    if s.pad_ms < 0 or s.min_speech_ms < 0:
        raise VadError("pad_ms and min_speech_ms must not be negative")
    if s.max_window_s * 1000 < 8 * s.frame_ms:
        raise VadError(f"max_window_s ({s.max_window_s}) must be at least eight frames")
    # The soft cut scores a frame with both neighbours: four frames always hold one.
    search_ms = s.soft_cut_search_s * 1000
    if not (4 * s.frame_ms <= search_ms <= s.max_window_s * 1000 - 2 * s.frame_ms):
        raise VadError(
            f"soft_cut_search_s ({s.soft_cut_search_s}) must be between four frames "
            f"and max_window_s ({s.max_window_s}) minus two frames"
        )
    if s.pad_ms + s.min_speech_ms >= s.max_window_s * 1000 - search_ms:
        raise VadError(
            f"pad_ms + min_speech_ms ({s.pad_ms + s.min_speech_ms}) must be shorter than "
            "max_window_s minus soft_cut_search_s, or a segment could outgrow the window "
            "before it is confirmed"
        )
