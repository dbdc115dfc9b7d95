"""The batch worker: consumes the job stream, VAD-segments long audio into decode
windows (for Whisper's transcription, consecutive segments joined up to
``batch_window_s``; otherwise one per segment), batches windows across jobs, runs
the engine, stores results (see ``lanes.queue``).
(Over 400 lines: one consumer whose steps all act on the same held jobs.)

Loop, one iteration:

1. store the result of every job whose windows are all decoded (result first,
   then the ``XACK``, in one script);
2. take more entries (reclaimed ones first, then new ones) while the held jobs
   have less than ``batch_max_audio_s`` of audio left and fewer than
   ``batch_max_jobs`` are held; each is started, its audio VAD-segmented into
   windows (a missing, empty or corrupt blob fails at once);
3. check for cancelled or lost jobs (the worker stops a job within one batch);
4. decode one batch: the oldest held jobs' next windows, up to
   ``batch_max_audio_s``; progress (audio done / audio total) is written after it.

The default decode runs one engine call per window off the event loop, and
uses the engine's piecewise decoder when it has one (pocketsphinx holds the GIL
for a whole call), so Redis touches and heartbeats keep running. Redis errors
are waited out with exponential backoff (jittered, ``lanegate.retry``); held jobs stay
in memory meanwhile.
SIGTERM: the current batch finishes, finished jobs are stored, and every other
held job is handed back to the queue (not counted as an attempt).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any, Protocol

import redis.asyncio as aioredis
from aiohttp import web
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from engines.base import DEFAULT_OPTIONS, DecodeOptions, Hypothesis, Task
from lanegate import metrics
from lanegate.blobs import BlobError, BlobStore
from lanegate.constants import ENGINE_SAMPLE_RATE, SAMPLE_WIDTH, WorkerLane
from lanegate.logs import get_logger
from lanegate.redis_io import redis_client
from lanegate.retry import Backoff
from lanegate.settings import Settings
from lanegate.transcript import Transcript
from lanegate.webhooks import WebhookDispatcher
from lanes import registry
from lanes.batching import Batch, HeldJob, jobs_of, next_batch, undispatch
from lanes.job_audio import PoisonAudio, audio_path, load_windows, read_segment, to_cues
from lanes.job_protocol import Delivery, Outcome, Standing
from lanes.queue import JobQueue
from lanes.sweeper import BlobSweeper
from vad import VadSettings
from workers import process
from workers.process import WorkerShell, default_worker_id, on_stop_signals, wait

#: mixed mode's decode: segments that share decoder options, in one call
Decode = Callable[[list[bytes], DecodeOptions], Awaitable[list[Hypothesis]]]

#: how long an idle worker blocks on XREADGROUP (bounds its reaction to SIGTERM)
BLOCK_MS = 500
#: Redis outage backoff: first delay and cap
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
_END = object()
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, ReadOnlyError)

log = get_logger("workers.batch")


class BatchEngine(Protocol):
    """The part of ``engines.base.Engine`` the batch lane needs."""

    name: str

    def transcribe_batch(self, segments: Sequence[bytes],
                         options: DecodeOptions = DEFAULT_OPTIONS) -> list[Hypothesis]: ...


def _by_options(batch: list[tuple[HeldJob, int]], pcms: list[bytes]
                ) -> dict[DecodeOptions, list[tuple[HeldJob, int, bytes]]]:
    """The batch's windows grouped by their job's decoder options (language, prompt,
    temperature, task): one engine call decodes one group."""
    groups: dict[DecodeOptions, list[tuple[HeldJob, int, bytes]]] = {}
    for (held, index), pcm in zip(batch, pcms, strict=True):
        groups.setdefault(held.options, []).append((held, index, pcm))
    return groups


def _record(group: list[tuple[HeldJob, int, bytes]], hyps: list[Hypothesis]) -> None:
    for (held, index, _), hyp in zip(group, hyps, strict=True):
        held.results.append(to_cues(held.windows[index], hyp))
        held.detected.append(hyp.language)


class BatchConsumer:
    """Consumes ``JOB_STREAM`` as one consumer of ``JOB_GROUP``."""

    def __init__(self, settings: Settings, redis: aioredis.Redis, engine: BatchEngine, *,
                 lane: WorkerLane = WorkerLane.BATCH, decode: Decode | None = None,
                 worker_id: str | None = None, webhooks: bool = True) -> None:
        self.settings = settings
        self.redis = redis
        self.engine = engine
        self.lane = lane
        self.webhooks = webhooks
        self.worker_id = worker_id or settings.worker_id or default_worker_id()
        self.queue = JobQueue(redis, settings, self.worker_id)
        self.blobs = BlobStore(settings.blob_path)
        self.vad = VadSettings.from_settings(settings)
        self._custom_decode = decode
        self._held: dict[str, HeldJob] = {}
        self._next_reclaim = 0.0
        self._backoff = Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S)  # jittered: see lanegate.retry
        self.ready = False
        self.log = log.bind(lane=lane, worker=self.worker_id)

    # --- the loop -----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Process jobs until ``stop`` is set; then hand back what is unfinished.

        Also runs a ``WebhookDispatcher`` (unless ``webhooks=False``) for as long,
        so every process that consumes jobs also delivers their webhooks, and the
        ``BlobSweeper`` of orphaned blobs."""
        done = asyncio.Event()
        helpers = [asyncio.create_task(self._touch_loop(stop))]
        if self.webhooks:
            hooks = WebhookDispatcher(self.redis, self.settings, worker=self.worker_id)
            helpers.append(asyncio.create_task(hooks.run(done)))
        sweeper = BlobSweeper(self.redis, self.settings, worker=self.worker_id)
        helpers.append(asyncio.create_task(sweeper.run(done)))
        try:
            await self._until_ok(stop, self._prepare)
            while not stop.is_set():
                await self._guarded(stop, self._iteration, stop)
            await self._shutdown()
        finally:
            done.set()
            helpers[0].cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            self.ready = False

    async def _prepare(self) -> None:
        await self.queue.ensure_group()
        for delivery in await self.queue.read_own_pending():
            await self._accept(delivery)
        self.ready = True

    async def _iteration(self, stop: asyncio.Event) -> None:
        await self._store_ready()
        await self._fill(stop)
        if not self._held:
            return
        await self._check()
        batch = next_batch(self._held.values(),
                           self.settings.batch_max_audio_s * ENGINE_SAMPLE_RATE)
        if batch:
            await self._run_batch(batch)
        await self._store_ready()

    async def _guarded(self, stop: asyncio.Event | None, op: Callable[..., Awaitable[None]],
                       *args: Any) -> bool:
        """Run ``op``; on a Redis outage wait (with backoff) and return False."""
        try:
            await op(*args)
        except REDIS_ERRORS as exc:
            self.ready = False
            delay = self._backoff.next_s()
            self.log.warning("redis_unavailable", error=str(exc), retry_in_s=delay)
            await wait(stop, delay)
            return False
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.log.warning("redis_group_missing", error=str(exc))
            await self.queue.ensure_group()
            return False
        self._backoff.reset()
        self.ready = True
        return True

    async def _until_ok(self, stop: asyncio.Event, op: Callable[[], Awaitable[None]]) -> None:
        while not stop.is_set() and not await self._guarded(stop, op):
            pass

    # --- taking jobs ----------------------------------------------------------------

    def _wants_more(self) -> bool:
        if any(h.isolated for h in self._held.values()):
            return False  # a suspect job runs with nothing new beside it (a crash costs less)
        held_audio = sum(h.remaining_s for h in self._held.values())
        return (len(self._held) < self.settings.batch_max_jobs
                and held_audio < self.settings.batch_max_audio_s)

    async def _fill(self, stop: asyncio.Event) -> None:
        while self._wants_more() and not stop.is_set():
            deliveries = await self._reclaim_due()
            if not deliveries:
                deliveries = await self.queue.read(1, None if self._held else BLOCK_MS)
            if not deliveries:
                return
            for delivery in deliveries:
                await self._accept(delivery)

    async def _reclaim_due(self) -> list[Delivery]:
        now = time.monotonic()
        if now < self._next_reclaim:
            return []
        found = await self.queue.reclaim(1)
        if not found:
            self._next_reclaim = now + max(0.05, self.settings.claim_idle_s / 4)
        return found

    async def _accept(self, d: Delivery) -> None:
        if d.job_id in self._held:  # our own entry, re-delivered: already held
            return
        started = await self.queue.start(d)
        jlog = self.log.bind(job_id=d.job_id, entry=d.entry_id)
        if started.outcome is Outcome.SKIP:
            jlog.info("job_skipped", reason=started.reason)
            return
        if started.outcome is Outcome.DEAD:
            self._count("failed")
            jlog.warning("job_dead_lettered", reason=started.reason)
            self._delete_audio(d.job_id)
            return
        job = started.job
        if started.first and job is not None:
            metrics.QUEUE_WAIT.labels(lane=self.lane, worker=self.worker_id).observe(
                max(0.0, time.time() - job.created_at))
        try:
            path = audio_path(self.blobs, d.job_id)
            windows, samples = await asyncio.to_thread(
                load_windows, path, self.vad,
                self._window_s(job.task if job else Task.TRANSCRIBE))
        except PoisonAudio as exc:
            await self._fail(d, started.attempt, str(exc))
            return
        # its last attempt was charged (an engine error, or its worker died): maybe the bad one
        held = HeldJob(d, started.attempt, job.language if job else "", path, windows,
                       samples, time.monotonic(), isolated=started.attempt > 1,
                       prompt=job.prompt if job else "",
                       temperature=job.temperature if job else None,
                       task=job.task if job else Task.TRANSCRIBE)
        self._held[d.job_id] = held
        jlog.info("job_started", attempt=started.attempt, audio_s=round(held.audio_s, 3),
                  windows=len(windows), segments=sum(len(w.parts) for w in windows),
                  queue_wait_s=round(time.time() - job.created_at, 3) if job else None)

    def _pieces(self) -> Callable[[bytes], Generator[Hypothesis | None, None, None]] | None:
        """The engine's piecewise decoder (pocketsphinx), or None for a batching engine
        (Whisper, the simulated one): it decides the decode path and the windows."""
        pieces: Callable[[bytes], Generator[Hypothesis | None, None, None]] | None = getattr(
            self.engine, "transcribe_segment_pieces", None)
        return pieces

    def _window_s(self, task: Task) -> float:
        """The longest decode window for a job: ``batch_window_s`` for a batching
        engine's transcription (Whisper hears 30 s at a time; measured on the shared
        recording). A piecewise engine (pocketsphinx: no 30 s context to fill) and the
        translate task decode each segment alone: translating 25 s windows of one
        sentence said eight times kept it three times (``tests/test_language.py``)."""
        if task is not Task.TRANSCRIBE or self._pieces() is not None:
            return 0.0
        return self.settings.batch_window_s

    async def _fail(self, d: Delivery, attempt: int, reason: str) -> None:
        if await self.queue.fail(d, attempt, reason):
            self._count("failed")
            self.log.warning("job_failed", job_id=d.job_id, attempt=attempt, reason=reason)
            self._delete_audio(d.job_id)
        self._held.pop(d.job_id, None)

    # --- between batches ------------------------------------------------------------

    async def _check(self) -> None:
        """Drop held jobs that were cancelled or that another attempt now owns."""
        if not self._held:
            return
        states = await self.queue.states({j: h.attempt for j, h in self._held.items()})
        for job_id, state in states.items():
            held = self._held.get(job_id)
            if held is None or state is Standing.OK:
                continue
            del self._held[job_id]
            if state is Standing.CANCELLED:
                await self.queue.drop(held.delivery)
                self._delete_audio(job_id)
                self.log.info("job_cancel_seen", job_id=job_id, attempt=held.attempt,
                              progress=round(held.progress, 4))
            else:
                self.log.warning("job_lost", job_id=job_id, attempt=held.attempt,
                                 reason="another attempt owns it, or it finished or expired")

    async def _run_batch(self, batch: Batch) -> None:
        try:
            pcms = [read_segment(h.path, h.windows[i]) for h, i in batch]
        except OSError as exc:  # the blob vanished: most likely cancelled just now
            undispatch(batch)
            await self._check()
            await self._fail_vanished(batch, exc)
            return
        audio_s = sum(len(p) for p in pcms) / SAMPLE_WIDTH / ENGINE_SAMPLE_RATE
        started = time.perf_counter()
        try:
            await self._decode_batch(batch, pcms)
        except REDIS_ERRORS:
            undispatch(batch)  # decoded windows are kept; the rest go in a later batch
            raise
        except Exception as exc:  # an engine error costs the jobs in the batch an attempt
            await self._engine_failed(batch, exc)
            return
        except BaseException:
            undispatch(batch)
            raise
        elapsed = time.perf_counter() - started
        self._observe_batch(audio_s, elapsed, len(pcms), len(jobs_of(batch)))

    async def _decode_batch(self, batch: Batch, pcms: list[bytes]) -> None:
        """Decode and record results; progress is written as each window lands
        (after every window with the default decode, after the call otherwise)."""
        if self._custom_decode is not None:
            for options, group in _by_options(batch, pcms).items():
                hyps = await self._custom_decode([p for _, _, p in group], options)
                if len(hyps) != len(group):
                    raise RuntimeError(f"decode returned {len(hyps)} results for {len(group)}")
                _record(group, hyps)
            for held in jobs_of(batch):
                await self._write_progress(held)
            return
        step = metrics.STEP_DURATION.labels(lane=self.lane, worker=self.worker_id)
        if self._pieces() is None:
            # A batching engine (Whisper): one call per set of decoder options.
            for options, group in _by_options(batch, pcms).items():
                t0 = time.perf_counter()
                hyps = await asyncio.to_thread(
                    self.engine.transcribe_batch, [p for _, _, p in group], options)
                step.observe(time.perf_counter() - t0)
                _record(group, hyps)
            for held in jobs_of(batch):
                await self._write_progress(held)
            return
        for (held, index), pcm in zip(batch, pcms, strict=True):
            t0 = time.perf_counter()
            hyp = await self._decode_one(pcm)
            step.observe(time.perf_counter() - t0)
            _record([(held, index, pcm)], [hyp])
            await self._write_progress(held)

    async def _write_progress(self, held: HeldJob) -> None:
        if not held.ready and self._held.get(held.job_id) is held:
            await self.queue.progress(held.delivery, held.attempt, held.progress,
                                      held.text_so_far)

    async def _fail_vanished(self, batch: Batch, exc: OSError) -> None:
        for held in jobs_of(batch):
            if held.job_id in self._held:
                await self._fail(held.delivery, held.attempt, f"audio blob vanished: {exc}")

    async def _engine_failed(self, batch: Batch, exc: Exception) -> None:
        """A batch of several jobs is retried one job at a time, uncharged; a job that
        fails alone is charged the attempt."""
        reason = f"engine error: {type(exc).__name__}: {exc}"
        jobs = jobs_of(batch)
        undispatch(batch)
        if len(jobs) > 1:
            for held in jobs:
                held.isolated = True
            self.log.warning("batch_failed", jobs=[h.job_id for h in jobs], reason=reason,
                             retry="one job at a time")
            return
        for held in jobs:
            self._held.pop(held.job_id, None)
            if await self.queue.release(held.delivery, held.attempt, count_attempt=True,
                                        error=reason):
                self.log.warning("job_retry", job_id=held.job_id, attempt=held.attempt,
                                 reason=reason)

    def _observe_batch(self, audio_s: float, elapsed: float, windows: int, jobs: int) -> None:
        labels = {"lane": self.lane, "worker": self.worker_id}
        metrics.AUDIO_SECONDS.labels(**labels).inc(audio_s)
        if audio_s > 0:
            metrics.REALTIME_FACTOR.labels(**labels).observe(elapsed / audio_s)
        self.log.info("batch_decoded", windows=windows, jobs=jobs,
                      audio_s=round(audio_s, 3), elapsed_s=round(elapsed, 3),
                      rtf=round(elapsed / audio_s, 4) if audio_s else None)

    # --- results ----------------------------------------------------------------------

    async def _store_ready(self) -> None:
        for held in [h for h in self._held.values() if h.ready]:
            transcript = Transcript.from_segments(held.cues, held.audio_s,
                                                  held.result_language)
            stored = await self.queue.complete(held.delivery, held.attempt, transcript)
            self._held.pop(held.job_id, None)
            if not stored:
                self.log.warning("job_lost", job_id=held.job_id, attempt=held.attempt,
                                 reason="result refused: cancelled or owned by another attempt")
                continue
            self._completed(held)

    def _completed(self, held: HeldJob) -> None:
        duration = time.monotonic() - held.claimed_at
        labels = {"lane": self.lane, "worker": self.worker_id}
        metrics.JOB_DURATION.labels(**labels).observe(duration)
        self._count("completed")
        for seg in (part for window in held.windows for part in window.parts):
            metrics.SOFT_CUTS.labels(**labels, reason=seg.reason).inc()
        self._delete_audio(held.job_id)
        self.log.info("job_completed", job_id=held.job_id, attempt=held.attempt,
                      audio_s=round(held.audio_s, 3), duration_s=round(duration, 3),
                      segments=len(held.cues))

    # --- shutdown and liveness ----------------------------------------------------------

    async def _shutdown(self) -> None:
        """Store finished jobs and hand every other held job back (not an attempt)."""
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self._held and time.monotonic() < deadline:
            if await self._guarded(None, self._hand_back_all):
                return
        if self._held:  # Redis never came back: the entries stay pending and are reclaimed
            self.log.warning("job_hand_back_failed", jobs=sorted(self._held))

    async def _hand_back_all(self) -> None:
        await self._store_ready()
        for held in list(self._held.values()):
            if await self.queue.release(held.delivery, held.attempt, count_attempt=False):
                self.log.info("job_handed_back", job_id=held.job_id, attempt=held.attempt,
                              progress=round(held.progress, 4))
            self._held.pop(held.job_id, None)

    async def _touch_loop(self, stop: asyncio.Event) -> None:
        """Keep held entries from being reclaimed while this worker is alive."""
        period = max(0.05, self.settings.claim_idle_s / 4)
        while True:
            await asyncio.sleep(period)
            held = {h.delivery.entry_id: h for h in self._held.values()}
            if not held:
                continue
            try:
                owned = await self.queue.touch(list(held))
            except REDIS_ERRORS:
                continue
            for entry_id, h in held.items():
                if entry_id not in owned and self._held.get(h.job_id) is h:
                    self._held.pop(h.job_id, None)
                    self.log.warning("job_lost", job_id=h.job_id, attempt=h.attempt,
                                     reason="entry reclaimed by another worker")

    # --- engine -------------------------------------------------------------------------

    async def _decode_one(self, pcm: bytes) -> Hypothesis:
        pieces = self._pieces()
        if pieces is None:
            return (await asyncio.to_thread(self.engine.transcribe_batch, [pcm]))[0]
        gen = pieces(pcm)
        try:
            while True:
                item = await _next_piece(gen)
                if isinstance(item, Hypothesis):
                    return item
                if item is _END:
                    raise RuntimeError("engine yielded no final hypothesis")
        finally:
            gen.close()  # ends the engine's utterance if we stopped early

    # --- helpers ------------------------------------------------------------------------

    def _count(self, status: str) -> None:
        metrics.JOBS.labels(lane=self.lane, worker=self.worker_id, status=status).inc()

    def _delete_audio(self, job_id: str) -> None:
        with contextlib.suppress(BlobError):
            self.blobs.delete(job_id)

    @property
    def held_jobs(self) -> list[str]:
        return list(self._held)


async def _next_piece(gen: Generator[Hypothesis | None, None, None]) -> object:
    """``next(gen)`` in a thread. If the caller is cancelled meanwhile, the piece
    (about 1 s of audio) is let finish first, so the generator can then be closed."""
    piece = asyncio.ensure_future(asyncio.to_thread(next, gen, _END))
    try:
        return await asyncio.shield(piece)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await piece
        raise


# --- the process ----------------------------------------------------------------------


def main(settings: Settings) -> int:
    """Run one batch worker process until SIGTERM/SIGINT; exit code."""
    return process.main(settings, WorkerLane.BATCH, _serve)


async def _serve(settings: Settings) -> int:
    from engines import create_engine

    stop = asyncio.Event()
    on_stop_signals(stop.set)
    engine = await asyncio.to_thread(create_engine, settings, slots=0)
    redis = redis_client(settings.redis_url)
    consumer = BatchConsumer(settings, redis, engine)

    def info() -> registry.WorkerInfo:
        return registry.WorkerInfo(worker_id=consumer.worker_id, lane=WorkerLane.BATCH,
                                   url=shell.url, engine=engine.name, slots_total=0,
                                   slots_free=0, step_p99_ms=0.0)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "worker": consumer.worker_id})

    async def readyz(_: web.Request) -> web.Response:
        status = 200 if consumer.ready else 503
        return web.json_response({"ready": consumer.ready, "held_jobs": consumer.held_jobs},
                                 status=status)

    shell = WorkerShell(settings, redis, WorkerLane.BATCH, consumer.worker_id, info)
    await shell.start(shell.app(healthz, readyz))
    log.info("worker_started", url=shell.url, engine=engine.name)
    try:
        await consumer.run(stop)
    finally:
        await shell.close()
        await redis.aclose()
    log.info("worker_stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main(Settings.from_env()))
