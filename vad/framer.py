"""Cut pushed PCM into whole VAD frames at a webrtcvad rate, with their energies.

Audio at a rate webrtcvad lacks goes through a soxr stream first. soxr output
depends on how its input is chunked, so the framer feeds it fixed-size blocks
(in float, undithered): then any chunking of the same audio yields exactly the
same frames.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import soxr

from lanegate.constants import SAMPLE_WIDTH
from vad.settings import VadSettings

# Block of caller-rate audio handed to the resampler at a time.
RESAMPLE_BLOCK_MS = 10

Frames = tuple[bytes, npt.NDArray[np.int64]]


class Framer:
    """Accumulates PCM and releases whole frames plus their sums of squares."""

    def __init__(self, settings: VadSettings) -> None:
        self.rate = settings.vad_rate
        self.frame_samples = self.rate * settings.frame_ms // 1000
        self.frame_bytes = self.frame_samples * SAMPLE_WIDTH
        self._buf = bytearray()
        self._resampler: soxr.ResampleStream | None = None
        self._in_buf = bytearray()
        self._block_bytes = settings.sample_rate * RESAMPLE_BLOCK_MS // 1000 * SAMPLE_WIDTH
        if self.rate != settings.sample_rate:
            self._resampler = soxr.ResampleStream(
                settings.sample_rate, self.rate, 1, dtype="float32", quality="HQ"
            )

    @property
    def buffered_samples(self) -> int:
        """Samples at the VAD rate waiting to complete a frame."""
        return len(self._buf) // SAMPLE_WIDTH

    def push(self, pcm: bytes | bytearray | memoryview) -> Frames:
        if self._resampler is None:
            self._buf += pcm
        else:
            self._in_buf += pcm
            self._resample_blocks(last=False)
        return self._take_frames()

    def flush(self) -> Frames:
        """Drain the resampler; a trailing partial frame stays in the buffer."""
        if self._resampler is not None:
            self._resample_blocks(last=True)
        return self._take_frames()

    def _resample_blocks(self, last: bool) -> None:
        assert self._resampler is not None
        block = self._block_bytes
        whole = len(self._in_buf) // block * block
        for off in range(0, whole, block):
            chunk = np.frombuffer(bytes(self._in_buf[off : off + block]), dtype=np.int16)
            self._buf += _to_int16(self._resampler.resample_chunk(chunk.astype(np.float32)))
        del self._in_buf[:whole]
        if last:
            tail = np.frombuffer(bytes(self._in_buf), dtype=np.int16).astype(np.float32)
            self._buf += _to_int16(self._resampler.resample_chunk(tail, last=True))
            self._in_buf.clear()

    def _take_frames(self) -> Frames:
        n = len(self._buf) // self.frame_bytes
        if n == 0:
            return b"", np.zeros(0, dtype=np.int64)
        frames = bytes(self._buf[: n * self.frame_bytes])
        del self._buf[: n * self.frame_bytes]
        return frames, frame_energies(frames, self.frame_samples)


def _to_int16(x: npt.NDArray[np.float32]) -> bytes:
    # soxr's own int16 output is dithered at random, which would make the VAD's
    # decisions differ between two runs over the same audio.
    return np.clip(np.rint(x), -32768, 32767).astype(np.int16).tobytes()


def frame_energies(frames: bytes, frame_samples: int) -> npt.NDArray[np.int64]:
    """Short-time energy per frame: exact integer sum of squares of the first difference.

    The first difference (pre-emphasis) flattens the low-frequency rumble of fans,
    traffic and brown noise, which otherwise decides where the quietest frame is;
    speech energy lies above it. Integers keep the value independent of chunking.
    """
    x = np.frombuffer(frames, dtype=np.int16).astype(np.int64).reshape(-1, frame_samples)
    d = x[:, 1:] - x[:, :-1]
    out: npt.NDArray[np.int64] = np.einsum("ij,ij->i", d, d)
    return out
