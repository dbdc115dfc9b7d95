"""Test audio in every container the upload API promises, encoded with PyAV.

``encode(wav, "mp3", out_dir)`` turns a WAV (e.g. espeak-ng speech from the
``speech`` fixture) into that format, stereo at a typical rate of the format,
so decoding has to downmix and resample as it would for a real upload.
"""

from __future__ import annotations

import wave
from pathlib import Path

import av
import numpy as np

#: extension -> (PyAV container format, codec, sample rate)
FORMATS: dict[str, tuple[str, str, int]] = {
    "wav": ("wav", "pcm_s16le", 44100),
    "flac": ("flac", "flac", 48000),
    "ogg": ("ogg", "libopus", 48000),
    "mp3": ("mp3", "libmp3lame", 44100),
    "m4a": ("ipod", "aac", 44100),
    "webm": ("webm", "libopus", 48000),
}

#: what a client would send as the part's or body's Content-Type
MIME = {
    "wav": "audio/wav", "flac": "audio/flac", "ogg": "audio/ogg", "mp3": "audio/mpeg",
    "m4a": "audio/mp4", "webm": "audio/webm",
}


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path)) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
        return pcm, w.getframerate()


def encode(src: Path, ext: str, out_dir: Path, *, layout: str = "stereo") -> Path:
    """``src`` (mono s16 WAV) re-encoded as ``ext``; cached in ``out_dir``."""
    out = out_dir / f"{src.stem}.{layout}.{ext}"
    if out.exists():
        return out
    fmt, codec, rate = FORMATS[ext]
    pcm, src_rate = read_wav(src)
    tmp = out.with_suffix(".part")
    with av.open(str(tmp), "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=rate, layout=layout)
        assert isinstance(stream, av.AudioStream)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = src_rate
        resampler = av.AudioResampler(format=stream.format.name, layout=layout, rate=rate)
        for piece in [*resampler.resample(frame), *resampler.resample(None)]:
            for packet in stream.encode(piece):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    tmp.rename(out)
    return out


def video_only(out: Path) -> Path:
    """A short Matroska file with one video stream and no audio."""
    with av.open(str(out), "w", format="matroska") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for _ in range(5):
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
            for packet in stream.encode(frame.reformat(format="yuv420p")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out


def silence_wav(out: Path, seconds: float, rate: int = 16000) -> Path:
    """A WAV of digital silence (cheap long audio for duration limits)."""
    frames = int(seconds * rate)
    with wave.open(str(out), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        chunk = b"\x00\x00" * rate
        for _ in range(frames // rate):
            w.writeframes(chunk)
        w.writeframes(b"\x00\x00" * (frames % rate))
    return out
