"""``lanegate transcribe`` end to end: the CLI as a subprocess against a real stack."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from audio_files import encode
from conftest import free_port
from phrases import MOST, SHORT
from phrases import recall as overlap
from stack import REPO, Stack, start_stack

from lanegate.upload_client import ProgressBar

KEY = "cli-key"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_stack(tmp_path_factory.mktemp("cli-stack"),
                          settings={"LANEGATE_API_KEYS": KEY})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def short_wav(speech: Callable[..., Path]) -> Path:
    return speech(SHORT)


def transcribe(url: str, *args: str, key: str | None = KEY) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "lanegate.cli", "transcribe", *args, "--url", url]
    if key is not None:
        argv += ["--api-key", key]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, timeout=120, check=False)
    # decoded by hand: text mode would turn the progress bar's "\r" into "\n"
    return subprocess.CompletedProcess(argv, done.returncode, done.stdout.decode(),
                                       done.stderr.decode())


def test_short_file_prints_text(stack: Stack, short_wav: Path) -> None:
    done = transcribe(stack.url, str(short_wav))
    assert done.returncode == 0, done.stderr
    assert overlap(SHORT, done.stdout) >= MOST, done.stdout
    assert "\r[" not in done.stderr  # answered at once: no job, no progress bar


def test_srt_saved_to_a_file(stack: Stack, short_wav: Path, tmp_path: Path) -> None:
    mp3 = encode(short_wav, "mp3", tmp_path)
    out = tmp_path / "out.srt"
    done = transcribe(stack.url, str(mp3), "--format", "srt", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert f"saved to {out}" in done.stderr
    srt = out.read_text()
    assert re.match(r"1\n00:00:\d\d,\d{3} --> 00:00:\d\d,\d{3}\n", srt), srt
    assert overlap(SHORT, srt) >= MOST


def test_async_job_shows_a_progress_bar(stack: Stack, short_wav: Path) -> None:
    done = transcribe(stack.url, str(short_wav), "--async", "--format", "vtt")
    assert done.returncode == 0, done.stderr
    assert re.search(r"queued as job [0-9a-f]{32}", done.stderr)
    frames = [f for f in done.stderr.split("\r") if f.startswith("[")]
    assert frames, done.stderr
    assert re.fullmatch(r"\[#{30}\] 100%  completed\s*\n", frames[-1]), frames[-1]
    assert done.stdout.startswith("WEBVTT")
    assert overlap(SHORT, done.stdout) >= MOST


def test_errors_exit_non_zero_with_a_message(stack: Stack, short_wav: Path,
                                             tmp_path: Path) -> None:
    missing = transcribe(stack.url, str(tmp_path / "nope.wav"))
    assert missing.returncode == 2
    assert "no such file" in missing.stderr

    wrong_key = transcribe(stack.url, str(short_wav), key="not-the-key")
    assert wrong_key.returncode == 1
    assert "error 401 (unauthorized)" in wrong_key.stderr

    notes = tmp_path / "notes.wav"
    notes.write_text("not audio\n" * 100)
    bad = transcribe(stack.url, str(notes))
    assert bad.returncode == 1
    assert "error 415 (unsupported_format)" in bad.stderr

    down = transcribe(f"http://127.0.0.1:{free_port()}", str(short_wav))
    assert down.returncode == 1
    assert "cannot reach" in down.stderr


def test_progress_bar_rendering() -> None:
    out = io.StringIO()
    bar = ProgressBar(out)
    bar.show(0.0, "queued")
    bar.show(0.0, "queued")  # unchanged: not redrawn
    bar.show(0.5, "processing")
    bar.show(1.0, "completed")
    bar.done()
    frames = out.getvalue().split("\r")[1:]
    assert len(frames) == 3
    assert frames[0].startswith("[" + "." * 30 + "]   0%  queued")
    assert frames[1].startswith("[" + "#" * 15 + "." * 15 + "]  50%  processing")
    assert frames[2].endswith("100%  completed \n")
