"""Streaming resampling of PCM s16le mono to the engines' 16 kHz (soxr, not decimation)."""

from __future__ import annotations

import numpy as np
import soxr

from engines.base import BYTES_PER_SAMPLE
from lanegate.constants import ENGINE_SAMPLE_RATE


class StreamResampler:
    """Push PCM at ``in_rate``, get PCM at ``out_rate``; ``flush()`` drains the filter.

    An odd trailing byte is kept for the next push, so any chunking works.
    At equal rates it passes audio through untouched.
    """

    def __init__(self, in_rate: int, out_rate: int = ENGINE_SAMPLE_RATE,
                 quality: str = "HQ") -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._carry = b""
        self._stream: soxr.ResampleStream | None = None
        if in_rate != out_rate:
            self._stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="int16",
                                               quality=quality)

    def push(self, pcm: bytes) -> bytes:
        data = self._carry + pcm
        whole = len(data) - len(data) % BYTES_PER_SAMPLE
        self._carry = data[whole:]
        if self._stream is None:
            return data[:whole]
        if whole == 0:
            return b""
        samples = np.frombuffer(data[:whole], dtype=np.int16)
        out: bytes = self._stream.resample_chunk(samples).tobytes()
        return out

    def flush(self) -> bytes:
        self._carry = b""
        if self._stream is None:
            return b""
        out: bytes = self._stream.resample_chunk(np.zeros(0, dtype=np.int16), last=True).tobytes()
        return out
