"""Shared fixtures: a real redis-server per test (startable, killable, restartable)
and real synthesized speech (espeak-ng + sox), cached per test session."""

from __future__ import annotations

import hashlib
import os
import pty
import shutil
import subprocess
import time
import wave
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import redis

from lanegate.supervisor import free_port

VOICE = "en-us+klatt"
WPM = 130


def wait_for_redis(port: int, timeout_s: float = 10.0) -> None:
    """Until a redis-server (or sentinel) on ``port`` answers PING."""
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    try:
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
    finally:
        client.close()
    raise RuntimeError(f"redis-server did not start on port {port}")


class RedisServer:
    """A redis-server child with AOF on, in its own directory."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.workdir), "--appendonly", "yes", "--appendfsync", "always",
             "--save", "", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for_redis(self.port)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    servers: list[RedisServer] = []

    def make() -> RedisServer:
        server = RedisServer(tmp_path / f"redis{len(servers)}")
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.kill()


@pytest.fixture
def redis_server(redis_factory: Callable[[], RedisServer]) -> RedisServer:
    return redis_factory()


def synthesize(text: str, out: Path, *, rate: int = 16000, voice: str = VOICE,
               wpm: int = WPM) -> Path:
    """espeak-ng speech, converted by sox to mono s16le WAV at ``rate``.

    ``sox -R`` seeds its dither the same way every time: without it the same text gave
    different samples in every test session, so a recall measured once did not hold
    on the next run."""
    raw = out.with_suffix(".espeak.wav")
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(wpm), "-w", str(raw), text],
                   check=True, capture_output=True)
    subprocess.run(["sox", "-R", str(raw), "-r", str(rate), "-c", "1", "-b", "16", str(out)],
                   check=True, capture_output=True)
    raw.unlink()
    return out


@pytest.fixture(scope="session")
def speech_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("speech")


@pytest.fixture(scope="session")
def speech(speech_dir: Path) -> Callable[..., Path]:
    """``speech(text, rate=16000)`` -> cached WAV path of that text spoken."""
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        pytest.fail("espeak-ng and sox are required (apt-get install espeak-ng sox)")

    def make(text: str, rate: int = 16000) -> Path:
        digest = hashlib.sha1(f"{text}|{rate}".encode()).hexdigest()[:16]
        path = speech_dir / f"{digest}.wav"
        if not path.exists():
            synthesize(text, path, rate=rate)
        return path

    return make


def read_pcm(path: Path | str) -> tuple[bytes, int]:
    """PCM s16le mono bytes and sample rate of a WAV file."""
    with wave.open(os.fspath(path)) as w:
        return w.readframes(w.getnframes()), w.getframerate()


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session for a test's HTTP and WebSocket calls, closed after it."""
    async with aiohttp.ClientSession() as session:
        yield session


@pytest_asyncio.fixture
async def floor_url() -> AsyncIterator[str]:
    """``bench.floor``'s bare /v1/stream server on a free loopback port, for the bench's
    load client."""
    from aiohttp import web

    from bench.floor import make_app

    runner = web.AppRunner(make_app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"ws://127.0.0.1:{port}/v1/stream"
    await runner.cleanup()


@pytest.fixture(scope="session")
def whisper_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir whose bundled Whisper base is assembled (once per test session)."""
    from engines import models

    data = tmp_path_factory.mktemp("whisper-data")
    models.resolve("base", str(data))
    return data


@pytest.fixture(scope="session")
def whisper(whisper_data: Path) -> Any:
    """The real Whisper base engine, loaded once per test session (4 slots)."""
    from engines.whisper import WhisperEngine
    from lanegate.settings import Settings

    return WhisperEngine(Settings(data_dir=str(whisper_data)), slots=4)


def on_terminal(argv: list[str], *, stream: str = "stdout", cwd: Path | str | None = None,
                env: dict[str, str] | None = None, timeout_s: float = 120.0) -> tuple[int, str]:
    """Run ``argv`` with its ``stream`` (stdout or stderr) on a pseudo-terminal and the
    other one discarded: (exit code, what it showed on the terminal)."""
    leader, follower = pty.openpty()
    streams = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, stream: follower}
    try:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=streams["stdout"],
                                stderr=streams["stderr"])
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = proc.wait(timeout_s)
    finally:
        os.close(leader)
    return code, b"".join(chunks).decode(errors="replace")
