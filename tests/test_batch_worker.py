"""workers/batch.py: the batch worker, in-process and as real processes that the
tests SIGKILL and SIGTERM, against a real redis-server that they kill and restart.

The main end-to-end test runs pocketsphinx on a 90 s espeak-ng recording; the
queue-mechanics tests use the simulated engine slowed down (sim_prefill_frame_ms)
so that a job spans many batches.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from conftest import RedisServer, free_port, read_pcm
from phrases import MOST, PARAGRAPH, recall
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from engines import Hypothesis, create_engine
from engines.base import DecodeOptions, Task
from engines.simulated import FAULT_EXIT_CODE, words_of
from lanegate.blobs import new_id
from lanegate.constants import DEAD_LETTER_STREAM, JOB_GROUP, JOB_STREAM, RESULT_KEY
from lanegate.redis_io import redis_client
from lanegate.settings import Settings
from lanes.job_audio import audio_path, load_windows, read_segment
from lanes.job_protocol import Job
from lanes.jobs import JobStore
from lanes.registry import list_workers
from vad import VadSettings
from workers.batch import BatchConsumer

REPO = Path(__file__).resolve().parent.parent
LONG_TEXT = ". ".join([PARAGRAPH] * 6)  # about 92 s at the fixture's voice and pace

#: the simulated engine slowed to about 0.05 s per audio second, 5 s segments, decode
#: windows and batches: a 92 s job takes about 20 batches and 5 s
SLOW_SIM = {"engine": "simulated", "sim_prefill_frame_ms": 0.5, "max_window_s": 5.0,
            "soft_cut_search_s": 2.0, "batch_max_audio_s": 5.0, "batch_window_s": 5.0}


@pytest.fixture(scope="module")
def long_pcm(speech_dir: Path) -> bytes:
    from conftest import synthesize

    path = speech_dir / "batch_long.wav"
    if not path.exists():
        synthesize(LONG_TEXT, path)
    pcm, rate = read_pcm(path)
    assert rate == 16000
    return pcm


class Env:
    def __init__(self, settings: Settings, client: aioredis.Redis) -> None:
        self.settings = settings
        self.redis = client
        self.store = JobStore(client, settings)

    async def submit(self, pcm: bytes, tenant: str = "t1", **kwargs: Any) -> str:
        job_id = new_id()
        self.store.blobs.path(job_id).write_bytes(pcm)
        job, _ = await self.store.submit(job_id=job_id, tenant=tenant,
                                         audio_seconds=len(pcm) / 32000, **kwargs)
        return job.id

    async def job(self, job_id: str, tenant: str = "t1") -> Job:
        job = await self.store.get(job_id, tenant)
        assert job is not None
        return job

    async def until(self, job_id: str, pred: Callable[[Job], bool],
                    timeout_s: float = 120.0) -> Job:
        """Poll the job until ``pred`` holds (the timeout only guards a hang)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                job = await self.job(job_id)
                if pred(job):
                    return job
            except (RedisConnectionError, RedisTimeoutError):
                pass  # a test restarting Redis
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} never satisfied the condition")
            await asyncio.sleep(0.05)


@pytest.fixture
async def env_factory(redis_server: RedisServer,
                      tmp_path: Path) -> AsyncIterator[Callable[..., Env]]:
    clients: list[aioredis.Redis] = []

    def make(**overrides: Any) -> Env:
        settings = Settings(redis_url=redis_server.url, blob_dir=str(tmp_path / "blobs"),
                            heartbeat_s=0.2, **overrides)
        client = redis_client(settings.redis_url)
        clients.append(client)
        return Env(settings, client)

    yield make
    for client in clients:
        await client.aclose()


# --- worker processes ---------------------------------------------------------------


class WorkerProcess:
    """``python -m workers.batch`` with its settings in the environment."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.settings = settings
        self.log_path = log_path
        self.port = settings.worker_port
        env = {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1"}
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "workers.batch"], cwd=REPO,
                                     env=env, stdout=self._log, stderr=self._log)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    async def ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.events()
            try:
                if (await asyncio.to_thread(self.get, "/readyz"))[0] == 200:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.1)
        raise AssertionError(f"worker never became ready: {self.events()}")

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and (name is None or event.get("event") == name):
                out.append(event)
        return out

    async def logged(self, name: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """The events called ``name``, waiting for the first one to be written."""
        deadline = time.monotonic() + timeout_s
        while not (found := self.events(name)) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        return found

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def terminate(self, timeout_s: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def close(self) -> None:
        self.kill()
        self._log.close()


@pytest.fixture
def worker_factory(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """``start(env, worker_id=..., **settings)`` -> a running worker process."""
    procs: list[WorkerProcess] = []

    def start(env: Env, worker_id: str | None = None, **overrides: Any) -> WorkerProcess:
        wid = worker_id or f"w{len(procs)}"
        settings = env.settings.replace(worker_id=wid, worker_port=free_port(), **overrides)
        proc = WorkerProcess(settings, tmp_path / f"{wid}.log")
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.close()


# --- in-process consumers -------------------------------------------------------------


@pytest.fixture
async def consumer_factory() -> AsyncIterator[Callable[..., Awaitable[BatchConsumer]]]:
    """``start(env, decode=None)`` -> a BatchConsumer running in this event loop."""
    running: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start(env: Env, **kwargs: Any) -> BatchConsumer:
        engine = create_engine(env.settings, slots=0)
        consumer = BatchConsumer(env.settings, env.redis, engine,
                                 worker_id=f"c{len(running)}", **kwargs)
        stop = asyncio.Event()
        running.append((stop, asyncio.create_task(consumer.run(stop))))
        return consumer

    yield start
    for stop, _ in running:
        stop.set()
    for _, task in running:
        await asyncio.wait_for(task, 60)


async def _stream_is_empty(client: aioredis.Redis) -> None:
    assert await client.xlen(JOB_STREAM) == 0
    assert (await client.xpending(JOB_STREAM, JOB_GROUP))["pending"] == 0


# --- end to end with pocketsphinx -----------------------------------------------------


async def test_90s_recording_through_a_worker_process_with_pocketsphinx(
    env_factory: Callable[..., Env], worker_factory: Callable[..., WorkerProcess],
    long_pcm: bytes,
) -> None:
    env = env_factory(engine="pocketsphinx")
    worker = worker_factory(env)
    job_id = await env.submit(long_pcm, filename="meeting.wav")
    await worker.ready()
    seen: list[float] = []

    def record(job: Job) -> bool:
        if not seen or job.progress != seen[-1]:
            seen.append(job.progress)
        return job.terminal

    job = await env.until(job_id, record, timeout_s=240)
    assert job.status == "completed", job.error
    assert job.attempts == 1
    assert seen[-1] == 1.0
    assert seen == sorted(seen)
    assert any(0.0 < p < 1.0 for p in seen), seen  # progress was written as it went

    result = await env.store.result(job_id, "t1")
    assert result is not None
    assert abs(result.duration - len(long_pcm) / 32000) < 0.01
    assert recall(PARAGRAPH, result.text) >= MOST, result.text
    assert len(result.segments) >= 4  # VAD segments, none over the 25 s window
    assert all(s.end - s.start <= 25.0 + 1e-6 for s in result.segments)
    assert [s.start for s in result.segments] == sorted(s.start for s in result.segments)
    words = [w for s in result.segments for w in s.words]
    assert words
    assert all(0.0 <= w.start <= w.end <= result.duration + 0.01 for w in words)
    assert not env.store.blobs.exists(job_id)  # audio deleted once the result is stored
    await _stream_is_empty(env.redis)

    status, body = await asyncio.to_thread(worker.get, "/metrics")
    assert status == 200
    assert 'lanegate_jobs_total{lane="batch",status="completed",worker="w0"} 1.0' in body
    assert "lanegate_step_duration_seconds_count" in body
    assert (await asyncio.to_thread(worker.get, "/healthz"))[0] == 200
    assert [w.worker_id for w in await list_workers(env.redis, "batch")] == ["w0"]
    completed = await worker.logged("job_completed")
    assert len(completed) == 1
    assert completed[0]["job_id"] == job_id
    assert completed[0]["lane"] == "batch"
    assert completed[0]["worker"] == "w0"
    assert completed[0]["duration_s"] > 0
    assert worker.terminate() == 0


# --- crashes, restarts, shutdown --------------------------------------------------------


@pytest.mark.parametrize("recovery", ["another_worker", "same_worker_restarted"])
async def test_sigkill_mid_job_completes_exactly_once(
    env_factory: Callable[..., Env], worker_factory: Callable[..., WorkerProcess],
    long_pcm: bytes, recovery: str,
) -> None:
    env = env_factory(claim_idle_s=1.0, **SLOW_SIM)
    first = worker_factory(env, worker_id="first")
    await first.ready()
    job_id = await env.submit(long_pcm)
    await env.until(job_id, lambda j: 0.2 < j.progress < 0.8)
    first.kill()
    assert (await env.job(job_id)).status == "processing"

    second = worker_factory(env, worker_id="second" if recovery == "another_worker"
                            else "first")
    job = await env.until(job_id, lambda j: j.terminal)
    assert job.status == "completed"
    assert job.attempts == 2
    assert job.worker == ("second" if recovery == "another_worker" else "first")
    assert len(await second.logged("job_completed")) == 1
    assert await env.redis.exists(RESULT_KEY.format(job_id=job_id)) == 1
    result = await env.store.result(job_id, "t1")
    assert result is not None
    assert result.segments[-1].end == pytest.approx(len(long_pcm) / 32000, abs=0.01)
    await _stream_is_empty(env.redis)


async def test_redis_restart_with_jobs_queued_and_running_loses_none(
    env_factory: Callable[..., Env], worker_factory: Callable[..., WorkerProcess],
    redis_server: RedisServer, long_pcm: bytes,
) -> None:
    env = env_factory(**SLOW_SIM)
    worker = worker_factory(env)
    await worker.ready()
    short = long_pcm[: 30 * 32000]
    jobs = [await env.submit(short) for _ in range(3)]
    await env.until(jobs[0], lambda j: j.progress > 0.1)
    redis_server.kill()  # appendfsync always: everything acknowledged is on disk
    await asyncio.sleep(3.0)  # longer than the client's own retries: the worker backs off
    redis_server.start()
    for job_id in jobs:
        job = await env.until(job_id, lambda j: j.terminal)
        assert job.status == "completed", job.error
        assert await env.store.result(job_id, "t1") is not None
    assert worker.proc.poll() is None  # it reconnected by itself
    assert await worker.logged("redis_unavailable")
    await _stream_is_empty(env.redis)


async def test_worker_started_before_redis_waits_for_it(
    env_factory: Callable[..., Env], worker_factory: Callable[..., WorkerProcess],
    redis_server: RedisServer, long_pcm: bytes,
) -> None:
    env = env_factory(engine="simulated")
    job_id = await env.submit(long_pcm[: 5 * 32000])
    redis_server.stop()
    worker = worker_factory(env)
    await worker.logged("redis_unavailable")
    assert worker.proc.poll() is None
    assert (await asyncio.to_thread(worker.get, "/readyz"))[0] == 503
    redis_server.start()
    await worker.ready()
    assert (await env.until(job_id, lambda j: j.terminal)).status == "completed"


async def test_job_that_keeps_crashing_workers_goes_to_the_dead_letter_stream(
    env_factory: Callable[..., Env], worker_factory: Callable[..., WorkerProcess],
    long_pcm: bytes,
) -> None:
    env = env_factory(claim_idle_s=0.5, max_attempts=2, **SLOW_SIM)
    job_id = await env.submit(long_pcm)
    for attempt in (1, 2):
        worker = worker_factory(env)
        await env.until(job_id, lambda j, a=attempt: j.attempts == a and j.progress > 0)
        worker.kill()
    last = worker_factory(env)
    job = await env.until(job_id, lambda j: j.terminal)
    assert job.status == "failed"
    assert job.error == ("gave up after 2 attempts: the worker stopped during every attempt")
    dead = await env.redis.xrange(DEAD_LETTER_STREAM)
    assert len(dead) == 1
    assert dead[0][1][b"job_id"] == job_id.encode()
    assert len(await last.logged("job_dead_lettered")) == 1
    await _stream_is_empty(env.redis)
    # the worker that dead-lettered it carries on with other work
    ok = await env.submit(long_pcm[: 5 * 32000])
    assert (await env.until(ok, lambda j: j.terminal)).status == "completed"


async def test_sigterm_hands_the_job_back_and_exits_0(
    env_factory: Callable[..., Env], worker_factory: Callable[..., WorkerProcess],
    long_pcm: bytes,
) -> None:
    env = env_factory(**SLOW_SIM)
    first = worker_factory(env)
    await first.ready()
    job_id = await env.submit(long_pcm)
    await env.until(job_id, lambda j: 0.1 < j.progress < 0.7)
    assert first.terminate() == 0
    back = await env.job(job_id)
    assert back.status == "queued"
    assert back.attempts == 0  # a clean hand-back is not a failed attempt
    assert len(await first.logged("job_handed_back")) == 1
    assert await list_workers(env.redis, "batch") == []  # deregistered on the way out

    second = worker_factory(env)
    job = await env.until(job_id, lambda j: j.terminal)
    assert job.status == "completed"
    assert job.attempts == 1
    assert len(await second.logged("job_completed")) == 1
    await _stream_is_empty(env.redis)


async def test_sigterm_when_idle_exits_0(
    env_factory: Callable[..., Env], worker_factory: Callable[..., WorkerProcess],
) -> None:
    worker = worker_factory(env_factory(engine="simulated"))
    await worker.ready()
    assert worker.terminate() == 0
    assert worker.events("worker_stopped")


# --- in-process: poison, cancel, batching ------------------------------------------------


async def test_poison_audio_fails_at_once(
    env_factory: Callable[..., Env],
    consumer_factory: Callable[..., Awaitable[BatchConsumer]], long_pcm: bytes,
) -> None:
    env = env_factory(engine="simulated", max_attempts=3)
    odd = await env.submit(b"\x01\x02\x03")
    empty = await env.submit(b"")
    missing = await env.submit(long_pcm[:32000])
    env.store.blobs.delete(missing)
    good = await env.submit(long_pcm[: 5 * 32000])
    await consumer_factory(env)
    reasons = {
        odd: "corrupt audio blob: 3 bytes is not whole 16-bit samples",
        empty: "audio blob is empty",
        missing: "audio blob is missing",
    }
    for job_id, reason in reasons.items():
        job = await env.until(job_id, lambda j: j.terminal)
        assert (job.status, job.error, job.attempts) == ("failed", reason, 1)
    assert (await env.until(good, lambda j: j.terminal)).status == "completed"
    assert await env.redis.xlen(DEAD_LETTER_STREAM) == 0
    await _stream_is_empty(env.redis)


async def test_silence_completes_with_an_empty_transcript(
    env_factory: Callable[..., Env],
    consumer_factory: Callable[..., Awaitable[BatchConsumer]],
) -> None:
    env = env_factory(engine="simulated")
    job_id = await env.submit(b"\x00\x00" * 16000 * 3)
    await consumer_factory(env)
    assert (await env.until(job_id, lambda j: j.terminal)).status == "completed"
    result = await env.store.result(job_id, "t1")
    assert result is not None
    assert (result.text, result.segments, result.duration) == ("", (), 3.0)


async def test_cancel_stops_the_worker_within_one_batch(
    env_factory: Callable[..., Env],
    consumer_factory: Callable[..., Awaitable[BatchConsumer]], long_pcm: bytes,
) -> None:
    env = env_factory(**SLOW_SIM)
    calls: list[int] = []
    holder: list[BatchConsumer] = []

    async def decode(pcms: list[bytes], options: DecodeOptions) -> list[Hypothesis]:
        calls.append(len(pcms))
        return await asyncio.to_thread(holder[0].engine.transcribe_batch, pcms, options)

    job_id = await env.submit(long_pcm)
    consumer = await consumer_factory(env, decode=decode)
    holder.append(consumer)
    await env.until(job_id, lambda j: j.progress > 0.1)
    cancelled = await env.store.cancel(job_id, "t1")
    assert cancelled is not None
    assert cancelled.status == "cancelled"
    at_cancel = len(calls)
    deadline = time.monotonic() + 30
    while job_id in consumer.held_jobs and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    assert job_id not in consumer.held_jobs
    assert len(calls) - at_cancel <= 1
    job = await env.job(job_id)
    assert job.status == "cancelled"
    assert await env.store.result(job_id, "t1") is None
    assert not env.store.blobs.exists(job_id)
    await _stream_is_empty(env.redis)


async def test_segments_of_several_jobs_share_batches(
    env_factory: Callable[..., Env],
    consumer_factory: Callable[..., Awaitable[BatchConsumer]], long_pcm: bytes,
) -> None:
    env = env_factory(engine="simulated", batch_max_audio_s=40.0, max_window_s=10.0)
    batches: list[float] = []
    holder: list[BatchConsumer] = []

    async def decode(pcms: list[bytes], options: DecodeOptions) -> list[Hypothesis]:
        batches.append(sum(len(p) for p in pcms) / 32000)
        return await asyncio.to_thread(holder[0].engine.transcribe_batch, pcms, options)

    jobs = [await env.submit(long_pcm[: 15 * 32000]) for _ in range(3)]
    consumer = await consumer_factory(env, decode=decode)
    holder.append(consumer)
    for job_id in jobs:
        assert (await env.until(job_id, lambda j: j.terminal)).status == "completed"
    assert max(batches) > 15.0  # one engine call carried segments of two jobs or more
    assert all(b <= 40.0 for b in batches)
    texts = {(await env.store.result(j, "t1")).text for j in jobs}  # type: ignore[union-attr]
    assert len(texts) == 1  # same audio, same text, whichever batch it rode in


async def test_each_job_is_decoded_with_its_own_options(
    env_factory: Callable[..., Env],
    consumer_factory: Callable[..., Awaitable[BatchConsumer]], long_pcm: bytes,
) -> None:
    env = env_factory(engine="simulated", batch_max_audio_s=40.0, max_window_s=10.0)
    seen: list[tuple[DecodeOptions, int]] = []
    holder: list[BatchConsumer] = []

    async def decode(pcms: list[bytes], options: DecodeOptions) -> list[Hypothesis]:
        seen.append((options, len(pcms)))
        return await asyncio.to_thread(holder[0].engine.transcribe_batch, pcms, options)

    asks = [{"language": "de-AT", "prompt": "Wien"}, {"temperature": 0.5}, {},
            {"task": Task.TRANSLATE}]
    jobs = [await env.submit(long_pcm[: 15 * 32000], **ask) for ask in asks]
    consumer = await consumer_factory(env, decode=decode)
    holder.append(consumer)
    for job_id in jobs:
        assert (await env.until(job_id, lambda j: j.terminal)).status == "completed"
    assert {options for options, _ in seen} == {
        DecodeOptions(language="de", prompt="Wien"), DecodeOptions(temperature=0.5),
        DecodeOptions(), DecodeOptions(task=Task.TRANSLATE)}
    result = await env.store.result(jobs[0], "t1")
    assert result is not None
    assert result.language == "de-AT"
    assert (await env.job(jobs[0])).language == "de-AT"  # asked for: kept as asked
    assert (await env.job(jobs[2])).language == "en"  # the simulated engine knows English only


async def test_two_workers_share_the_queue_and_each_job_runs_once(
    env_factory: Callable[..., Env],
    consumer_factory: Callable[..., Awaitable[BatchConsumer]], long_pcm: bytes,
) -> None:
    env = env_factory(engine="simulated", batch_max_audio_s=10.0, batch_max_jobs=1,
                      max_window_s=5.0, soft_cut_search_s=2.0)
    jobs = [await env.submit(long_pcm[: 10 * 32000]) for _ in range(6)]
    await consumer_factory(env)
    await consumer_factory(env)
    done = [await env.until(j, lambda x: x.terminal) for j in jobs]
    assert {j.status for j in done} == {"completed"}
    assert {j.attempts for j in done} == {1}
    await _stream_is_empty(env.redis)


# --- a bad job is charged alone ------------------------------------------------------------

#: innocent jobs and one job whose audio makes the engine fail, all batched together
INNOCENT_S, POISON_AT_S = 12, 40


def decoded_words(env: Env, job_id: str) -> set[str]:
    """Every word the simulated engine says for the job's windows, as a worker cuts them."""
    path = audio_path(env.store.blobs, job_id)
    windows, _ = load_windows(path, VadSettings.from_settings(env.settings),
                              env.settings.batch_window_s)
    return {w.word for win in windows for w in words_of(read_segment(path, win))}


async def submit_with_poison(env: Env, pcm: bytes) -> tuple[list[str], str, str]:
    """Innocent jobs around one poison job; and the word that makes the engine fail."""
    innocent = [await env.submit(pcm[: INNOCENT_S * 32000]) for _ in range(2)]
    poison = await env.submit(pcm[POISON_AT_S * 32000:(POISON_AT_S + 8) * 32000])
    innocent.append(await env.submit(pcm[: INNOCENT_S * 32000]))
    clean = set().union(*(decoded_words(env, j) for j in innocent))
    marker = sorted(decoded_words(env, poison) - clean)[0]
    return innocent, poison, marker


async def test_a_batch_that_fails_in_the_engine_charges_only_the_bad_job(
    env_factory: Callable[..., Env],
    consumer_factory: Callable[..., Awaitable[BatchConsumer]], long_pcm: bytes,
) -> None:
    probe = env_factory(engine="simulated")
    innocent, poison, marker = await submit_with_poison(probe, long_pcm)
    env = env_factory(engine="simulated", sim_fail_on=marker, max_attempts=3,
                      batch_max_audio_s=60.0, max_window_s=10.0)
    await consumer_factory(env)
    job = await env.until(poison, lambda j: j.terminal)
    assert job.status == "failed"
    assert job.error is not None
    assert job.error.startswith("gave up after 3 attempts: engine error: SimulatedFault")
    for job_id in innocent:
        done = await env.until(job_id, lambda j: j.terminal)
        assert (done.status, done.attempts) == ("completed", 1), done
    dead = await env.redis.xrange(DEAD_LETTER_STREAM)
    assert [fields[b"job_id"] for _, fields in dead] == [poison.encode()]
    await _stream_is_empty(env.redis)


async def test_a_job_that_crashes_the_process_is_the_only_one_dead_lettered(
    env_factory: Callable[..., Env], worker_factory: Callable[..., WorkerProcess],
    long_pcm: bytes,
) -> None:
    probe = env_factory(engine="simulated")
    innocent, poison, marker = await submit_with_poison(probe, long_pcm)
    env = env_factory(engine="simulated", sim_fail_on=marker, sim_fail_exit=True,
                      max_attempts=3, claim_idle_s=0.5, batch_max_audio_s=60.0,
                      max_window_s=10.0)
    crashes = 0
    while crashes < 8:  # the test restarts crashed workers, as a supervisor would
        worker = worker_factory(env)
        while worker.proc.poll() is None and not (await env.job(poison)).terminal:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if worker.proc.poll() is None:
            break
        assert worker.proc.returncode == FAULT_EXIT_CODE
        crashes += 1
    job = await env.until(poison, lambda j: j.terminal)
    assert job.status == "failed"
    assert crashes == 3, "the bad job crashed its worker once per attempt, no more"
    for job_id in innocent:
        done = await env.until(job_id, lambda j: j.terminal)
        assert done.status == "completed", done
        assert done.attempts <= 2, "one crash beside the bad job at most"
    dead = await env.redis.xrange(DEAD_LETTER_STREAM)
    assert [fields[b"job_id"] for _, fields in dead] == [poison.encode()]
