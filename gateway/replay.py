"""A live stream's audio since its last final, kept by the gateway for failover.

When a stream's worker is lost, the relay opens the session on another worker and
replays this audio there (``gateway/relay.py``, docs/ARCHITECTURE.md, "Losing a
worker"). Every final the client received covers the audio before its ``end_ms``,
so only what follows the last one is kept. The soft cut bounds speech between two
finals by ``max_window_s``; silence is not bounded, so neither is the audio since
the last final: past ``max_s`` the oldest audio is dropped (a long silence costs
nothing; a worker far behind its stream loses the earliest words of the next final
if it then fails).

Frames are kept as received (no copy) and replayed as they came, so no replayed
frame is larger than a client frame.
"""

from __future__ import annotations

from collections import deque

from lanegate.constants import SAMPLE_WIDTH


class ReplayBuffer:
    """Client audio (PCM s16le at the stream's rate) from ``start`` to ``end``, as
    absolute byte offsets in the stream."""

    def __init__(self, sample_rate: int, max_s: float) -> None:
        self.sample_rate = sample_rate
        self._max_bytes = int(max_s * sample_rate) * SAMPLE_WIDTH
        self._frames: deque[bytes] = deque()
        self._head = 0  # stream offset of _frames[0][0]
        self.start = 0  # first byte kept
        self.end = 0  # bytes received so far
        self.dropped = 0  # bytes dropped over the bound, in all

    def append(self, pcm: bytes) -> None:
        self._frames.append(pcm)
        self.end += len(pcm)
        over = self.end - self.start - self._max_bytes
        if over > 0:
            self.dropped += over
            self._advance(self.start + over)

    def offset_of(self, ms: float) -> int:
        """The byte offset of the sample at ``ms`` into the stream (floored to a sample)."""
        return int(ms * self.sample_rate / 1000) * SAMPLE_WIDTH

    def ms_of(self, offset: int) -> float:
        return offset / SAMPLE_WIDTH * 1000 / self.sample_rate

    def covered_until(self, ms: float) -> None:
        """A final covered the stream up to ``ms``: forget the audio before it."""
        self._advance(min(self.offset_of(ms), self.end))

    def _advance(self, start: int) -> None:
        if start <= self.start:
            return
        self.start = start
        while self._frames and self._head + len(self._frames[0]) <= start:
            self._head += len(self._frames.popleft())

    def frames(self, since: int, until: int | None = None) -> list[bytes]:
        """The kept audio from offset ``since`` (or ``start``, if later) to ``until``
        (default: ``end``)."""
        since = max(since, self.start)
        until = self.end if until is None else min(until, self.end)
        out: list[bytes] = []
        if since >= until:
            return out
        offset = self._head
        for frame in self._frames:
            if offset >= until:
                break
            if offset + len(frame) > since:
                out.append(frame[max(0, since - offset):until - offset])
            offset += len(frame)
        return out
