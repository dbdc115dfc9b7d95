"""Decoding uploads: every promised container to 16 kHz s16le mono, limits, clear errors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import soxr
from audio_files import FORMATS, encode, read_wav, silence_wav, video_only

from lanegate.audio import (
    TooLong,
    UndecodableAudio,
    UnsupportedFormat,
    decode_to_pcm,
    decode_upload,
    sniff,
)

SENTENCE = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def sentence_wav(speech: Callable[..., Path]) -> Path:
    return speech(SENTENCE, rate=22050)


@pytest.fixture(scope="module")
def encoded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("encoded")


def pcm_of(path: Path) -> np.ndarray:
    return np.frombuffer(path.read_bytes(), dtype=np.int16).astype(np.float32) / 32768.0


def similarity(ref: np.ndarray, got: np.ndarray, max_lag: int = 1600) -> float:
    """Peak normalised cross-correlation within ``max_lag`` samples (codec delays)."""
    n = len(ref) + len(got)
    cc = np.fft.irfft(np.fft.rfft(got, n) * np.conj(np.fft.rfft(ref, n)), n)
    window = np.r_[cc[: max_lag + 1], cc[-max_lag:]]
    return float(np.max(np.abs(window)) / np.sqrt(np.dot(ref, ref) * np.dot(got, got)))


@pytest.mark.parametrize("ext", sorted(FORMATS))
def test_every_format_decodes_to_16k_mono(ext: str, sentence_wav: Path, encoded_dir: Path,
                                          tmp_path: Path) -> None:
    source = encode(sentence_wav, ext, encoded_dir)  # stereo at 44.1/48 kHz
    pcm, rate = read_wav(sentence_wav)
    reference = soxr.resample(pcm.astype(np.float32) / 32768.0, rate, 16000)

    decoded = decode_to_pcm(source, tmp_path / "audio.pcm", max_seconds=60)

    assert decoded.source_channels == 2
    assert decoded.source_rate == FORMATS[ext][2]
    assert decoded.path.stat().st_size == decoded.nbytes == decoded.samples * 2
    assert decoded.seconds == pytest.approx(len(reference) / 16000, abs=0.05)
    assert similarity(reference, pcm_of(decoded.path)) > 0.95


def test_telephony_rate_is_upsampled(speech: Callable[..., Path], tmp_path: Path) -> None:
    source = speech(SENTENCE, rate=8000)
    pcm, _ = read_wav(source)
    decoded = decode_to_pcm(source, tmp_path / "audio.pcm", max_seconds=60)
    assert decoded.source_rate == 8000
    assert decoded.samples == pytest.approx(2 * len(pcm), abs=4)


def test_too_long_is_refused_while_decoding(tmp_path: Path) -> None:
    source = silence_wav(tmp_path / "six.wav", 6.0)
    dest = tmp_path / "audio.pcm"
    with pytest.raises(TooLong, match="limit") as info:
        decode_to_pcm(source, dest, max_seconds=5.0)
    assert info.value.status == 422
    assert info.value.code == "audio_too_long"
    assert not dest.exists()


def test_declared_duration_far_past_the_limit_is_refused_early(tmp_path: Path) -> None:
    source = silence_wav(tmp_path / "long.wav", 30.0)
    with pytest.raises(TooLong, match=r"30\.0 s"):
        decode_to_pcm(source, tmp_path / "audio.pcm", max_seconds=10.0)


def test_audio_at_the_limit_is_accepted(tmp_path: Path) -> None:
    source = silence_wav(tmp_path / "five.wav", 5.0)
    decoded = decode_to_pcm(source, tmp_path / "audio.pcm", max_seconds=5.0)
    assert decoded.seconds == pytest.approx(5.0)


@pytest.mark.parametrize(
    "content", [b"this is a text file, not audio\n" * 50, bytes(range(256)) * 200],
    ids=["text", "binary-noise"],
)
def test_unknown_format_is_415(content: bytes, tmp_path: Path) -> None:
    source = tmp_path / "upload"
    source.write_bytes(content)
    with pytest.raises(UnsupportedFormat, match="unsupported") as info:
        decode_to_pcm(source, tmp_path / "audio.pcm", max_seconds=60)
    assert info.value.status == 415


def test_damaged_known_container_is_422_with_reason(sentence_wav: Path, encoded_dir: Path,
                                                    tmp_path: Path) -> None:
    whole = encode(sentence_wav, "m4a", encoded_dir).read_bytes()
    source = tmp_path / "cut.m4a"
    source.write_bytes(whole[: len(whole) // 2])  # the index (moov) is lost
    assert sniff(source) == "mp4"
    with pytest.raises(UndecodableAudio, match="damaged mp4") as info:
        decode_to_pcm(source, tmp_path / "audio.pcm", max_seconds=60)
    assert info.value.status == 422


def test_file_without_audio_stream_is_422(tmp_path: Path) -> None:
    source = video_only(tmp_path / "video.mkv")
    with pytest.raises(UndecodableAudio, match="no audio stream"):
        decode_to_pcm(source, tmp_path / "audio.pcm", max_seconds=60)


def test_header_only_wav_holds_no_audio(tmp_path: Path) -> None:
    source = silence_wav(tmp_path / "empty.wav", 0.0)
    with pytest.raises(UndecodableAudio, match="no decodable audio"):
        decode_to_pcm(source, tmp_path / "audio.pcm", max_seconds=60)
    assert not (tmp_path / "audio.pcm").exists()


async def test_decoding_runs_off_the_event_loop(tmp_path: Path) -> None:
    source = silence_wav(tmp_path / "ten-minutes.wav", 600.0)
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    decoded = await decode_upload(source, tmp_path / "audio.pcm", max_seconds=3600)
    done.set()
    await task
    assert decoded.seconds == pytest.approx(600.0)
    assert ticks > 1  # the loop kept running while the thread decoded
