"""Streaming speech segmenter: webrtcvad frames, endpointing, max-window soft cut.

All decisions are made per frame on a fixed frame grid counted from the start
of the stream, so any chunking of the same audio yields the same events.
Internally positions are samples at the VAD rate; events are converted to the
caller's rate on the way out.
"""

from __future__ import annotations

import enum
import math
from collections import deque

import numpy as np
import numpy.typing as npt
import webrtcvad

from lanegate.constants import SAMPLE_WIDTH
from vad.errors import VadError
from vad.events import (
    SEGMENT_REASONS,
    SegmentEnded,
    SegmentReason,
    SpeechStarted,
    VadEvent,
)
from vad.framer import Framer
from vad.settings import VadSettings

__all__ = [
    "SEGMENT_REASONS",
    "SegmentEnded",
    "SpeechStarted",
    "StreamingSegmenter",
    "VadError",
    "VadEvent",
    "VadSettings",
    "segment_pcm",
]


class _State(enum.Enum):
    IDLE = 0
    PENDING = 1  # voiced frames seen, fewer than min_speech_ms so far
    OPEN = 2  # SpeechStarted emitted


class StreamingSegmenter:
    """Push PCM s16le mono at ``settings.sample_rate``; get speech segment events."""

    def __init__(self, settings: VadSettings = VadSettings()) -> None:  # noqa: B008
        self.settings = settings
        self._framer = Framer(settings)
        self._vad = webrtcvad.Vad(settings.aggressiveness)
        rate = self._framer.rate
        n = self._framer.frame_samples
        self._n = n
        self._ext_rate = settings.sample_rate
        self._pad = rate * settings.pad_ms // 1000
        self._min_voiced = max(1, math.ceil(settings.min_speech_ms / settings.frame_ms))
        self._endpoint_frames = math.ceil(settings.endpoint_silence_ms / settings.frame_ms)
        self._search = round(settings.soft_cut_search_s * rate)
        window_ext = round(settings.max_window_s * self._ext_rate)
        # With resampling, shrink the internal window so that rounding back to the
        # caller's rate can never make a segment longer than the window.
        self._window = (
            window_ext if rate == self._ext_rate else (window_ext - 1) * rate // self._ext_rate
        )
        # Enough frames for a search range that reaches back a whole window, even
        # when a segment's leading pad already makes it longer than one.
        span = max(self._window, self._pad + n)
        self._energies: deque[int] = deque(maxlen=span // n + 4)
        self._frames = 0  # frames classified so far
        self._position = 0  # caller-rate samples pushed
        self._state = _State.IDLE
        self._start = 0
        self._prev_end = 0
        self._last_voiced_end = 0
        self._voiced = 0
        self._silence = 0
        self._flushed = False

    @property
    def position(self) -> int:
        """Samples (caller rate) pushed so far."""
        return self._position

    @property
    def settled(self) -> int:
        """Caller-rate samples that no future endpoint cut ends at or before: all audio
        pushed, except the trailing silence of a segment still open and its last
        sample before the earliest end an endpoint could give it (the last speech plus
        the pad). A decoder that stops here still has the segment's last chunk to
        decode when the cut comes, never decodes past it. (A max-window soft cut may
        still end earlier: at the quietest point of its search range.)"""
        if self._state is _State.IDLE:
            return self._position
        # the earliest an endpoint can close it: at the next frame, after no more speech
        end = self._speech_end((self._frames + 1) * self._n)
        return min(self._position, self._to_ext(end) - 1)

    @property
    def earliest_needed(self) -> int:
        """Lowest caller-rate sample index any future event can reference."""
        if self._state is not _State.IDLE:
            return self._to_ext(self._start)
        if self._flushed:
            return self._position
        return self._to_ext(max(self._prev_end, self._frames * self._n - self._pad))

    def push(self, pcm: bytes | bytearray | memoryview) -> list[VadEvent]:
        if self._flushed:
            raise VadError("push() after flush(): the stream is finished")
        nbytes = memoryview(pcm).nbytes
        if nbytes % SAMPLE_WIDTH:
            raise VadError(
                f"PCM must be s16le mono (2 bytes per sample); got an odd byte count {nbytes}"
            )
        if nbytes == 0:
            return []
        self._position += nbytes // SAMPLE_WIDTH
        frames, energies = self._framer.push(pcm)
        return self._process(frames, energies)

    def flush(self) -> list[VadEvent]:
        """End of stream: classify what is left and close an open segment ("end")."""
        if self._flushed:
            return []
        frames, energies = self._framer.flush()
        events = self._process(frames, energies)
        self._flushed = True
        if self._state is _State.OPEN:
            end = min(self._position, self._to_ext(self._start + self._window))
            events.append(SegmentEnded(self._to_ext(self._start), end, "end"))
        self._state = _State.IDLE
        self._energies.clear()
        return events

    def cut(self) -> list[VadEvent]:
        """End an open segment at the last classified frame and keep listening (the
        caller committed its audio so far); a segment still pending is dropped."""
        if self._flushed:
            return []
        end = self._frames * self._n
        events: list[VadEvent] = []
        if self._state is _State.OPEN and end > self._start:
            events.append(SegmentEnded(self._to_ext(self._start), self._to_ext(end), "commit"))
        if self._state is not _State.IDLE:
            self._prev_end = end
        self._state = _State.IDLE
        return events

    def _process(self, frames: bytes, energies: npt.NDArray[np.int64]) -> list[VadEvent]:
        events: list[VadEvent] = []
        if not frames:
            return events
        is_speech = self._vad.is_speech
        rate = self._framer.rate
        fb = self._framer.frame_bytes
        view = memoryview(frames)
        append = self._energies.append
        for off, energy in zip(range(0, len(frames), fb), energies.tolist(), strict=True):
            append(energy)
            self._step(is_speech(view[off : off + fb], rate), events)
        return events

    def _step(self, speech: bool, events: list[VadEvent]) -> None:
        f_start = self._frames * self._n
        self._frames += 1
        f_end = f_start + self._n
        if speech:
            if self._state is _State.IDLE:
                self._state = _State.PENDING
                self._start = max(f_start - self._pad, self._prev_end, 0)
                self._voiced = 0
            self._voiced += 1
            self._silence = 0
            self._last_voiced_end = f_end
            if self._state is _State.PENDING and self._voiced >= self._min_voiced:
                self._state = _State.OPEN
                events.append(SpeechStarted(self._to_ext(self._start)))
        elif self._state is not _State.IDLE:
            self._silence += 1
            if self._silence >= self._endpoint_frames:
                self._close(self._speech_end(f_end), "endpoint", events)
                return
        if self._state is _State.PENDING and f_end - self._start >= self._window:
            self._state = _State.IDLE  # sparse blips never reached min_speech_ms
        while self._state is _State.OPEN and f_end - self._start >= self._window:
            self._soft_cut(events)

    def _speech_end(self, limit: int) -> int:
        # The lower bound only matters for the remainder of a cut that holds no speech.
        end = max(self._last_voiced_end + self._pad, self._start + self._n)
        return min(end, limit, self._start + self._window)

    def _close(self, end: int, reason: SegmentReason, events: list[VadEvent]) -> None:
        if self._state is _State.OPEN:
            events.append(SegmentEnded(self._to_ext(self._start), self._to_ext(end), reason))
            self._prev_end = end
        self._state = _State.IDLE

    def _soft_cut(self, events: list[VadEvent]) -> None:
        cut = self._quietest_point(self._start + self._window)
        events.append(SegmentEnded(self._to_ext(self._start), self._to_ext(cut), "max_window"))
        events.append(SpeechStarted(self._to_ext(cut)))
        self._start = cut

    def _quietest_point(self, window_end: int) -> int:
        """Middle of the quietest frame wholly inside the search range.

        A frame's score is its energy plus its two neighbours' (90 ms at 30 ms
        frames): a single quiet frame is as likely a stop closure inside a word as
        a gap between words; a quiet neighbourhood is a gap. Ties go to the latest.
        """
        n = self._n
        oldest = self._frames - len(self._energies)
        first = max(-(-(window_end - self._search) // n), oldest + 1)
        last = window_end // n - 2  # its right neighbour must be inside the window too
        if last < first:
            return window_end
        e = self._energies
        best, best_score = last, -1
        for f in range(last, first - 1, -1):
            i = f - oldest
            score = e[i - 1] + e[i] + e[i + 1]
            if best_score < 0 or score < best_score:
                best, best_score = f, score
        return best * n + n // 2

    def _to_ext(self, sample: int) -> int:
        if self._framer.rate == self._ext_rate:
            return sample
        return sample * self._ext_rate // self._framer.rate


def segment_pcm(pcm: bytes, settings: VadSettings = VadSettings()) -> list[SegmentEnded]:  # noqa: B008
    """Segments of a whole buffer: the streaming segmenter fed everything, then flushed."""
    view = memoryview(pcm).cast("B")
    if len(view) % SAMPLE_WIDTH:
        raise VadError(
            f"PCM must be s16le mono (2 bytes per sample); got an odd byte count {len(view)}"
        )
    seg = StreamingSegmenter(settings)
    # Fed in pieces so that working memory stays bounded for long files.
    step = settings.sample_rate * SAMPLE_WIDTH * 10
    events: list[VadEvent] = []
    for off in range(0, len(view), step):
        events += seg.push(view[off : off + step])
    events += seg.flush()
    return [e for e in events if isinstance(e, SegmentEnded)]
