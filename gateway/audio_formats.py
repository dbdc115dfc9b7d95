"""The input audio formats of the OpenAI Realtime API, decoded to PCM s16le for a worker.

``audio/pcm`` is s16le already (OpenAI's rate is 24 kHz; the worker resamples any
rate from 8 to 48 kHz, so the rate is declared, not converted). ``audio/pcmu`` and
``audio/pcma`` are G.711 mu-law and A-law at 8 kHz, one byte per sample, decoded
through a 256-entry table (ITU-T G.711; the standard library's ``audioop`` is gone
in Python 3.13).
"""

from __future__ import annotations

import enum

import numpy as np
import numpy.typing as npt


def _ulaw_table() -> npt.NDArray[np.int16]:
    codes = ~np.arange(256, dtype=np.int32) & 0xFF
    exponent = (codes >> 4) & 0x07
    magnitude = (((codes & 0x0F) << 3) + 0x84 << exponent) - 0x84
    return np.where(codes & 0x80, -magnitude, magnitude).astype(np.int16)


def _alaw_table() -> npt.NDArray[np.int16]:
    codes = np.arange(256, dtype=np.int32) ^ 0x55
    exponent = (codes >> 4) & 0x07
    mantissa = (codes & 0x0F) << 4
    magnitude = np.where(exponent == 0, mantissa + 8,
                         (mantissa + 0x108) << np.maximum(exponent - 1, 0))
    return np.where(codes & 0x80, magnitude, -magnitude).astype(np.int16)


ULAW = _ulaw_table()
ALAW = _alaw_table()


class AudioFormat(enum.Enum):
    """An input format: its GA ``type``, its beta ``input_audio_format`` name."""

    PCM = ("audio/pcm", "pcm16")
    PCMU = ("audio/pcmu", "g711_ulaw")
    PCMA = ("audio/pcma", "g711_alaw")

    def __init__(self, mime: str, beta: str) -> None:
        self.mime = mime
        self.beta = beta

    @classmethod
    def of_mime(cls, mime: str) -> AudioFormat | None:
        return next((f for f in cls if f.mime == mime), None)

    @classmethod
    def of_beta(cls, name: str) -> AudioFormat | None:
        return next((f for f in cls if f.beta == name), None)

    @property
    def is_g711(self) -> bool:
        return self is not AudioFormat.PCM

    def to_pcm(self, data: bytes) -> bytes:
        """``data`` in this format as PCM s16le (little-endian on any host)."""
        if self is AudioFormat.PCM:
            return data
        table = ULAW if self is AudioFormat.PCMU else ALAW
        return table[np.frombuffer(data, dtype=np.uint8)].astype("<i2").tobytes()


#: the one rate of G.711 audio
G711_RATE = 8000
#: OpenAI's rate for ``audio/pcm`` (and the beta ``pcm16``)
OPENAI_PCM_RATE = 24000
