"""``lanegate stream``: WAV checks, URL building, printing, and exit codes against
a real gateway subprocess (real redis-server; no worker, so it answers
``overloaded``). The happy path through ``lanegate up`` is in test_supervisor."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import wave
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RedisServer, free_port
from stack import lone_gateway as gateway_process

from lanegate.stream_client import Printer, read_audio, stream_url

PY = sys.executable


def write_wav(path: Path, *, channels: int = 1, width: int = 2, rate: int = 16000,
              seconds: float = 0.5) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(b"\x00" * int(rate * seconds) * channels * width)
    return path


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "lanegate.cli", "stream", *args], capture_output=True,
                          text=True, timeout=60, check=False, env=env)


def test_read_audio_resamples_any_rate_to_16k(tmp_path: Path) -> None:
    audio = read_audio(str(write_wav(tmp_path / "a.wav", rate=44100, seconds=1.0)))
    assert audio.sample_rate == 16000
    assert len(audio.pcm) == 16000 * 2
    assert audio.frame_bytes == 3200  # 100 ms
    assert audio.converted


@pytest.mark.parametrize(("kwargs", "source"), [
    ({"channels": 2}, "pcm_s16le 16000 Hz, 2 ch"),
    ({"width": 1}, "pcm_u8 16000 Hz, 1 ch"),
])
def test_read_audio_converts_other_layouts(tmp_path: Path, kwargs: dict[str, int],
                                           source: str) -> None:
    # these used to be refused with a sox command; the upload path's decoder reads them
    audio = read_audio(str(write_wav(tmp_path / "b.wav", **kwargs)))
    assert audio.source == f"wav {source}"
    assert len(audio.pcm) == 16000  # 0.5 s of 16 kHz s16 mono


def test_bad_files_exit_2_with_a_message(tmp_path: Path) -> None:
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"ID3 this is an mp3 really")
    result = cli(str(junk))
    assert result.returncode == 2
    assert "damaged mp3 file" in result.stderr
    result = cli(str(tmp_path / "missing.wav"))
    assert result.returncode == 2
    assert "no such file" in result.stderr


def test_stream_url_from_any_base() -> None:
    assert stream_url("http://h:8080", 8000) == "ws://h:8080/v1/stream?sample_rate=8000&language=en"
    assert stream_url("https://h/", 16000).startswith("wss://h/v1/stream?")
    assert stream_url("ws://h/v1/stream", 16000).startswith("ws://h/v1/stream?sample_rate")
    assert stream_url("http://h/prefix", 16000).startswith("ws://h/prefix/v1/stream?")


def test_printer_rewrites_partials_and_ends_finals() -> None:
    out = io.StringIO()
    p = Printer(out)
    p.partial("hello wor")
    p.partial("hello")
    p.final("hello world")
    assert out.getvalue() == "\rhello wor\rhello    \rhello world\n"


@pytest.fixture
def lone_gateway(tmp_path: Path, redis_server: RedisServer) -> Iterator[str]:
    """A real gateway process with Redis but no realtime worker."""
    with gateway_process(tmp_path, redis_server.url, LANEGATE_API_KEYS="sesame") as url:
        yield url


def test_error_events_exit_1_with_the_message(lone_gateway: str, tmp_path: Path) -> None:
    wav = str(write_wav(tmp_path / "s.wav"))
    result = cli(wav, "--url", lone_gateway)
    assert result.returncode == 1
    assert "error unauthorized" in result.stderr
    result = cli(wav, "--url", lone_gateway, "--api-key", "sesame")
    assert result.returncode == 1
    assert "error overloaded" in result.stderr
    env = {**os.environ, "LANEGATE_API_KEY": "sesame"}
    assert "error overloaded" in cli(wav, "--url", lone_gateway, env=env).stderr


def test_unreachable_gateway_exits_1(tmp_path: Path) -> None:
    result = cli(str(write_wav(tmp_path / "s.wav")), "--url", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 1
    assert "cannot stream to" in result.stderr
