"""Decode any uploaded audio to what the engines eat: 16 kHz s16le mono PCM.

PyAV wraps ffmpeg's libraries and its wheel bundles their codecs (Opus, MP3,
AAC, FLAC, Vorbis, PCM...), so every container the API promises decodes with
one ``pip install`` and no system ffmpeg. Decoding is streamed: packets are
demuxed, decoded, downmixed and resampled (``av.AudioResampler``, i.e.
libswresample) frame by frame and appended to the destination file, so a long
recording never sits in memory whole. The duration limit is enforced on the
samples actually produced while decoding (headers can lie), with an early
refusal when the container already declares a duration well past the limit.

The functions here block; the gateway calls :func:`decode_upload`, which runs
the decode in a thread so its event loop keeps serving other requests.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import av
import av.error

from lanegate.constants import ENGINE_SAMPLE_RATE, SAMPLE_WIDTH

#: the PCM sample rates a client may stream at (the worker resamples to 16 kHz)
MIN_STREAM_SAMPLE_RATE = 8000
MAX_STREAM_SAMPLE_RATE = 48000

#: an upload's declared duration may exceed the limit by this factor (VBR
#: estimates) before it is refused without decoding; samples decide otherwise
DECLARED_SLACK = 1.05

#: leading bytes of containers we promise to read; a file that starts like one
#: of these but cannot be opened is damaged (422), anything else is unknown (415)
_MAGIC: tuple[tuple[int, bytes, str], ...] = (
    (0, b"RIFF", "wav"),
    (0, b"RF64", "wav"),
    (0, b"fLaC", "flac"),
    (0, b"OggS", "ogg"),
    (0, b"ID3", "mp3"),
    (4, b"ftyp", "mp4"),
    (0, b"\x1a\x45\xdf\xa3", "webm"),
    (0, b"FORM", "aiff"),
)


class AudioError(Exception):
    """An upload that cannot become PCM. ``code`` is the API error code."""

    code = "undecodable_audio"
    status = 422


class UnsupportedFormat(AudioError):
    """Not a container or codec that the decoder knows (HTTP 415)."""

    code = "unsupported_format"
    status = 415


class UndecodableAudio(AudioError):
    """A known format whose data is damaged, or that holds no audio (HTTP 422)."""

    code = "undecodable_audio"
    status = 422


class TooLong(AudioError):
    """Longer than ``max_audio_seconds`` (HTTP 422)."""

    code = "audio_too_long"
    status = 422


@dataclass(frozen=True)
class DecodedAudio:
    """What the decoder wrote and what it read."""

    path: Path
    samples: int
    container: str
    codec: str
    source_rate: int
    source_channels: int

    @property
    def seconds(self) -> float:
        return self.samples / ENGINE_SAMPLE_RATE

    @property
    def nbytes(self) -> int:
        return self.samples * SAMPLE_WIDTH


def pcm_seconds(nbytes: int, sample_rate: int = ENGINE_SAMPLE_RATE) -> float:
    """Duration of ``nbytes`` of s16le mono PCM."""
    return nbytes / (SAMPLE_WIDTH * sample_rate)


def sniff(path: Path) -> str | None:
    """The container that the file's first bytes announce, if one we promise."""
    with open(path, "rb") as f:
        head = f.read(16)
    for offset, magic, name in _MAGIC:
        if head[offset:offset + len(magic)] == magic:
            return name
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        return "mp3"  # an MPEG audio frame sync, or ADTS AAC
    return None


def decode_to_pcm(src: Path, dest: Path, *, max_seconds: float,
                  sample_rate: int = ENGINE_SAMPLE_RATE) -> DecodedAudio:
    """Decode ``src`` (any container/codec) into ``dest`` as s16le mono at ``sample_rate``.

    Raises :class:`UnsupportedFormat`, :class:`UndecodableAudio` or :class:`TooLong`;
    ``dest`` is removed when decoding fails.
    """
    try:
        with _open(src) as container, open(dest, "wb") as out:
            stream = _audio_stream(container)
            _check_declared(container, stream, max_seconds)
            samples = _transcode(container, stream, out,
                                 max_samples=int(max_seconds * sample_rate), rate=sample_rate)
            ctx = stream.codec_context
            decoded = DecodedAudio(
                path=dest, samples=samples, container=str(container.format.name),
                codec=str(ctx.name), source_rate=int(ctx.sample_rate or 0),
                source_channels=int(ctx.channels or 0),
            )
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    if decoded.samples == 0:
        dest.unlink(missing_ok=True)
        raise UndecodableAudio("the file holds no decodable audio samples")
    return decoded


async def decode_upload(src: Path, dest: Path, *, max_seconds: float) -> DecodedAudio:
    """:func:`decode_to_pcm` in a worker thread, so the event loop stays responsive."""
    return await asyncio.to_thread(decode_to_pcm, src, dest, max_seconds=max_seconds)


def _open(src: Path) -> Any:
    try:
        return av.open(os.fspath(src), mode="r", metadata_errors="ignore")
    except av.error.FFmpegError as exc:
        known = sniff(src)
        reason = _reason(exc)
        if known is None:
            raise UnsupportedFormat(
                "unsupported or unrecognised audio format (accepted: wav, flac, ogg/opus, "
                f"mp3, m4a/aac, webm and other formats ffmpeg reads): {reason}"
            ) from exc
        raise UndecodableAudio(f"damaged {known} file: {reason}") from exc


def _audio_stream(container: Any) -> Any:
    streams = list(container.streams.audio)
    if not streams:
        raise UndecodableAudio(
            f"the {container.format.name} file contains no audio stream"
        )
    stream = streams[0]
    if stream.codec_context is None or not stream.codec_context.name:
        raise UnsupportedFormat("the audio codec of this file has no decoder")
    return stream


def _check_declared(container: Any, stream: Any, max_seconds: float) -> None:
    declared = _declared_seconds(container, stream)
    if declared is not None and declared > max_seconds * DECLARED_SLACK + 1.0:
        raise TooLong(
            f"audio is {declared:.1f} s long; the limit is {max_seconds:g} s"
        )


def _declared_seconds(container: Any, stream: Any) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration) / float(av.time_base)
    return None


def _transcode(container: Any, stream: Any, out: BinaryIO, *, max_samples: int,
               rate: int) -> int:
    resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
    written = 0
    try:
        for packet in container.demux(stream):
            for frame in packet.decode():
                written += _write(resampler.resample(frame), out)
                _check_length(written, max_samples, rate)
        written += _write(resampler.resample(None), out)
    except av.error.FFmpegError as exc:
        raise UndecodableAudio(f"decoding failed after {written / rate:.1f} s: "
                               f"{_reason(exc)}") from exc
    _check_length(written, max_samples, rate)
    return written


def _write(frames: list[Any], out: BinaryIO) -> int:
    count = 0
    for frame in frames:
        data = frame.to_ndarray()
        out.write(data.tobytes())
        count += int(data.shape[-1])
    return count


def _check_length(samples: int, max_samples: int, rate: int) -> None:
    if samples > max_samples:
        raise TooLong(
            f"audio is longer than the limit of {max_samples / rate:g} s"
        )


def _reason(exc: av.error.FFmpegError) -> str:
    text = getattr(exc, "strerror", None) or str(exc)
    return str(text)

