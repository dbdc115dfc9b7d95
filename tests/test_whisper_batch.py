"""The batch lane with the real Whisper base engine: a 3-minute job through a
``BatchConsumer`` (real Redis), batched decoding, word timings, the detected language;
the shared human recording's job, decoded in windows, cued per VAD segment."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from conftest import RedisServer, read_pcm, synthesize
from phrases import PARAGRAPH, recall

from bench.audio import SHARED_SPEECH, read_wav
from bench.wer import corpus_wer
from engines.base import DecodeOptions
from engines.whisper import WhisperEngine
from lanegate.blobs import new_id
from lanegate.settings import Settings
from lanes.job_audio import load_segments, pcm_windows
from lanes.jobs import Job, JobStore
from vad import VadSettings
from workers.batch import BatchConsumer

THREE_MINUTES = ". ".join([PARAGRAPH] * 12)  # about 184 s at the fixture's voice and pace


@pytest_asyncio.fixture
async def store(redis_server: RedisServer, tmp_path: Path) -> AsyncIterator[JobStore]:
    settings = Settings(redis_url=redis_server.url, blob_dir=str(tmp_path / "blobs"))
    client = aioredis.Redis.from_url(settings.redis_url)
    yield JobStore(client, settings)
    await client.aclose()


async def test_a_three_minute_job_completes_with_word_timings_and_its_language(
        store: JobStore, whisper: WhisperEngine, speech_dir: Path) -> None:
    path = speech_dir / "whisper_three_minutes.wav"
    if not path.exists():
        synthesize(THREE_MINUTES, path)
    pcm, _ = read_pcm(path)
    duration = len(pcm) / 32000
    assert duration > 170
    job_id = new_id()
    store.blobs.path(job_id).write_bytes(pcm)
    await store.submit(job_id=job_id, tenant="t1", audio_seconds=duration, language="")
    # batches of at most 60 s (the default 200 s would take it in one): progress between
    job, progress = await run_job(store, whisper, job_id, batch_max_audio_s=60.0)
    assert job.status == "completed", job.error
    assert any(0.0 < p < 1.0 for p in progress), progress  # written after each batch
    result = await store.result(job_id, "t1")
    assert result is not None
    assert result.language == "en"  # none given: detected
    assert recall(PARAGRAPH, result.text) >= 0.9, result.text[:500]
    words = [w for s in result.segments for w in s.words]
    assert len(words) > 300
    assert all(0.0 <= w.start <= w.end <= duration + 0.01 for w in words)
    starts = [w.start for w in words]
    assert starts == sorted(starts)


async def run_job(store: JobStore, whisper: WhisperEngine, job_id: str,
                  **settings: Any) -> tuple[Job, list[float]]:
    """The job through one ``BatchConsumer`` (``settings`` over the store's) until it
    ends; its progress as it went."""
    consumer = BatchConsumer(dataclasses.replace(store.settings, **settings), store.redis,
                             whisper, worker_id="wb")
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    progress: list[float] = []
    deadline = time.monotonic() + 600
    job: Job | None = None
    while time.monotonic() < deadline:
        job = await store.get(job_id, "t1")
        assert job is not None
        if not progress or job.progress != progress[-1]:
            progress.append(job.progress)
        if job.terminal:
            break
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(task, 60)
    assert job is not None
    return job, progress


def shared_pcm() -> bytes:
    """The shared recording at 16 kHz, converted by sox without dither (repeatable)."""
    return subprocess.run(
        ["sox", str(SHARED_SPEECH), "-t", "raw", "-r", "16000", "-c", "1", "-b", "16",
         "-e", "signed-integer", "-D", "-"], check=True, capture_output=True).stdout


@pytest.mark.skipif(not SHARED_SPEECH.exists(), reason="the shared human recording is not here")
async def test_a_human_recording_is_decoded_in_windows_and_cued_per_sentence(
        store: JobStore, whisper: WhisperEngine) -> None:
    """The shared recording (44 s, a person reading) as a job: its VAD segments go to
    Whisper as two windows of up to 25 s, and the transcript still has one cue per VAD
    segment, each holding the words said in it, its text those words. (What the windows
    buy in accuracy is measured on the recording x10 by ``bench.whisper_batch_vs_faster``
    and scenario 3; on this one copy both ways make two errors here.)"""
    pcm = shared_pcm()
    job_id = new_id()
    path = store.blobs.path(job_id)
    path.write_bytes(pcm)
    segments, _ = load_segments(path, VadSettings.from_settings(store.settings))
    await store.submit(job_id=job_id, tenant="t1", audio_seconds=len(pcm) / 32000,
                       language="en")
    job, _ = await run_job(store, whisper, job_id)
    assert job.status == "completed", job.error
    result = await store.result(job_id, "t1")
    assert result is not None
    reference = SHARED_SPEECH.with_suffix(".txt").read_text()
    wer = corpus_wer([(reference, result.text)])
    assert wer is not None
    assert wer <= 0.017, result.text  # at most two words of its 119 wrong
    assert [(c.start, c.end) for c in result.segments] == [
        (round(s.start / 16000, 3), round(s.end / 16000, 3)) for s in segments]
    assert len(segments) > 2
    for cue in result.segments:
        assert cue.text == " ".join(w.word for w in cue.words)
        assert all(cue.start - 0.3 <= w.start and w.end <= cue.end + 0.3 for w in cue.words), cue
    assert " ".join(c.text for c in result.segments if c.text) == result.text


@pytest.mark.skipif(not SHARED_SPEECH.exists(), reason="the shared human recording is not here")
def test_a_window_decodes_to_the_same_words_whatever_shares_its_call(
        whisper: WhisperEngine) -> None:
    """The batch lane puts windows of several users' jobs in one call. Padded to the call's
    longest, a window's words hung on its neighbours; padded to its own 5 s grid and batched
    only with windows padded alike, the recording's windows decode to the same words alone,
    together, and beside a shorter and a longer window of other speech."""
    pcm = read_wav(SHARED_SPEECH)  # as the benchmark reads it (sox -R)
    settings = Settings()
    windows = pcm_windows(pcm, VadSettings.from_settings(settings), settings.batch_window_s)
    assert len(windows) == 2
    first, second = windows
    short, longer = second[: 3 * 16000 * 2], first + first[: 3 * 16000 * 2]

    def texts(batch: list[bytes]) -> list[str]:
        return [h.text for h in whisper.transcribe_batch(batch, DecodeOptions(language="en"))]

    alone = [texts([w])[0] for w in windows]
    assert texts(windows) == alone
    assert texts([short, first, longer])[1] == alone[0]
    assert texts([second, longer, short])[0] == alone[1]
