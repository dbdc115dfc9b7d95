"""The batch worker: consumes the job stream, VAD-segments long audio, batches
segments across jobs, runs the engine, stores results (see ``lanes.queue``).

Loop, one iteration:

1. store the result of every job whose segments are all decoded (result first,
   then the ``XACK``, in one script);
2. take more entries (reclaimed ones first, then new ones) while the held jobs
   have less than ``batch_max_audio_s`` of audio left and fewer than
   ``batch_max_jobs`` are held; each is started, its audio VAD-segmented (a
   missing, empty or corrupt blob fails at once);
3. check for cancelled or lost jobs (the worker stops a job within one batch);
4. decode one batch: the oldest held jobs' next segments, up to
   ``batch_max_audio_s``; progress (audio done / audio total) is written after it.

The default decode runs one engine call per segment off the event loop, and
uses the engine's piecewise decoder when it has one (pocketsphinx holds the GIL
for a whole call), so Redis touches and heartbeats keep running. Redis errors
are waited out with exponential backoff; held jobs stay in memory meanwhile.
SIGTERM: the current batch finishes, finished jobs are stored, and every other
held job is handed back to the queue (not counted as an attempt).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import redis.asyncio as aioredis
from aiohttp import web
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lanegate import metrics
from lanegate.blobs import BlobError, BlobStore
from lanegate.constants import ENGINE_SAMPLE_RATE, SAMPLE_WIDTH
from lanegate.logs import configure_logging, get_logger
from lanegate.settings import Settings
from lanegate.transcript import Segment, Transcript, Word
from lanegate.webhooks import WebhookDispatcher
from lanes.queue import Delivery, JobQueue, redis_client
from vad import SegmentEnded, StreamingSegmenter, VadError, VadSettings
from workers import registry
from workers.engines.base import Hypothesis

Decode = Callable[[list[bytes]], Awaitable[list[Hypothesis]]]

#: how long an idle worker blocks on XREADGROUP (bounds its reaction to SIGTERM)
BLOCK_MS = 500
#: Redis outage backoff: first delay and cap
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
#: VAD reads the audio file in pieces this long
READ_CHUNK_S = 10
_END = object()
REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, ReadOnlyError)

log = get_logger("workers.batch")


class BatchEngine(Protocol):
    """The part of ``workers.engines.base.Engine`` the batch lane needs."""

    name: str

    def transcribe_batch(self, segments: Sequence[bytes]) -> list[Hypothesis]: ...


class PoisonAudio(ValueError):
    """A job's audio cannot be processed; retrying will not help."""


def audio_path(blobs: BlobStore, job_id: str) -> Path:
    """Where the job's PCM lives (without creating anything)."""
    try:
        return blobs.dir(job_id) / "audio.pcm"
    except BlobError as exc:
        raise PoisonAudio(str(exc)) from exc


def load_segments(path: Path, vad: VadSettings) -> tuple[list[SegmentEnded], int]:
    """VAD segments of a PCM blob and its length in samples; raises PoisonAudio."""
    if not path.is_file():
        raise PoisonAudio("audio blob is missing")
    size = path.stat().st_size
    if size == 0:
        raise PoisonAudio("audio blob is empty")
    if size % SAMPLE_WIDTH:
        raise PoisonAudio(f"corrupt audio blob: {size} bytes is not whole 16-bit samples")
    segmenter = StreamingSegmenter(vad)
    events: list[Any] = []
    try:
        with path.open("rb") as f:
            while chunk := f.read(READ_CHUNK_S * ENGINE_SAMPLE_RATE * SAMPLE_WIDTH):
                events += segmenter.push(chunk)
        events += segmenter.flush()
    except (OSError, VadError) as exc:
        raise PoisonAudio(f"unreadable audio blob: {exc}") from exc
    return [e for e in events if isinstance(e, SegmentEnded)], size // SAMPLE_WIDTH


def read_segment(path: Path, seg: SegmentEnded) -> bytes:
    with path.open("rb") as f:
        f.seek(seg.start * SAMPLE_WIDTH)
        return f.read(seg.length * SAMPLE_WIDTH)


def to_segment(seg: SegmentEnded, hyp: Hypothesis) -> Segment:
    offset = seg.start / ENGINE_SAMPLE_RATE
    words = tuple(Word(w.word, round(w.start + offset, 3), round(w.end + offset, 3))
                  for w in hyp.words)
    return Segment(start=round(offset, 3), end=round(seg.end / ENGINE_SAMPLE_RATE, 3),
                   text=hyp.text.strip(), words=words, cut=seg.reason)


@dataclass(eq=False)
class HeldJob:
    """A job this worker is processing (one attempt)."""

    delivery: Delivery
    attempt: int
    language: str
    path: Path
    segments: list[SegmentEnded]
    total_samples: int
    claimed_at: float  # time.monotonic()
    dispatched: int = 0  # segments handed to a batch
    results: list[Segment] = field(default_factory=list)

    @property
    def job_id(self) -> str:
        return self.delivery.job_id

    @property
    def ready(self) -> bool:
        return len(self.results) == len(self.segments)

    @property
    def remaining_s(self) -> float:
        left = sum(s.length for s in self.segments[self.dispatched:])
        return left / ENGINE_SAMPLE_RATE

    @property
    def progress(self) -> float:
        if not self.results or self.total_samples <= 0:
            return 0.0
        done = self.segments[len(self.results) - 1].end
        return min(1.0, done / self.total_samples)

    @property
    def audio_s(self) -> float:
        return self.total_samples / ENGINE_SAMPLE_RATE


class BatchConsumer:
    """Consumes ``JOB_STREAM`` as one consumer of ``JOB_GROUP``."""

    def __init__(self, settings: Settings, redis: aioredis.Redis, engine: BatchEngine, *,
                 lane: str = "batch", decode: Decode | None = None,
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
        self._backoff = BACKOFF_MIN_S
        self.ready = False
        self.log = log.bind(lane=lane, worker=self.worker_id)

    # --- the loop -----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Process jobs until ``stop`` is set; then hand back what is unfinished.

        Also runs a ``WebhookDispatcher`` (unless ``webhooks=False``) for as long,
        so every process that consumes jobs also delivers their webhooks."""
        done = asyncio.Event()
        helpers = [asyncio.create_task(self._touch_loop(stop))]
        if self.webhooks:
            hooks = WebhookDispatcher(self.redis, self.settings, worker=self.worker_id)
            helpers.append(asyncio.create_task(hooks.run(done)))
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
        batch = self._next_batch()
        if batch:
            await self._run_batch(batch)
        await self._store_ready()

    async def _guarded(self, stop: asyncio.Event, op: Callable[..., Awaitable[None]],
                       *args: Any) -> bool:
        """Run ``op``; on a Redis outage wait (with backoff) and return False."""
        try:
            await op(*args)
        except REDIS_ERRORS as exc:
            self.ready = False
            self.log.warning("redis_unavailable", error=str(exc), retry_in_s=self._backoff)
            await _wait(stop, self._backoff)
            self._backoff = min(BACKOFF_MAX_S, self._backoff * 2)
            return False
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.log.warning("redis_group_missing", error=str(exc))
            await self.queue.ensure_group()
            return False
        self._backoff = BACKOFF_MIN_S
        self.ready = True
        return True

    async def _until_ok(self, stop: asyncio.Event, op: Callable[[], Awaitable[None]]) -> None:
        while not stop.is_set() and not await self._guarded(stop, op):
            pass

    # --- taking jobs ----------------------------------------------------------------

    def _wants_more(self) -> bool:
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
        if started.outcome == "skip":
            jlog.info("job_skipped", reason=started.reason)
            return
        if started.outcome == "dead":
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
            segments, samples = await asyncio.to_thread(load_segments, path, self.vad)
        except PoisonAudio as exc:
            await self._fail(d, started.attempt, str(exc))
            return
        held = HeldJob(d, started.attempt, job.language if job else "en", path, segments,
                       samples, time.monotonic())
        self._held[d.job_id] = held
        jlog.info("job_started", attempt=started.attempt, audio_s=round(held.audio_s, 3),
                  segments=len(segments),
                  queue_wait_s=round(time.time() - job.created_at, 3) if job else None)

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
            if held is None or state == "ok":
                continue
            del self._held[job_id]
            if state == "cancelled":
                await self.queue.drop(held.delivery)
                self._delete_audio(job_id)
                self.log.info("job_cancel_seen", job_id=job_id, attempt=held.attempt,
                              progress=round(held.progress, 4))
            else:
                self.log.warning("job_lost", job_id=job_id, attempt=held.attempt,
                                 reason="another attempt owns it, or it finished or expired")

    def _next_batch(self) -> list[tuple[HeldJob, int]]:
        """The oldest held jobs' next segments, up to ``batch_max_audio_s`` (at least one)."""
        batch: list[tuple[HeldJob, int]] = []
        budget = self.settings.batch_max_audio_s * ENGINE_SAMPLE_RATE
        used = 0
        for held in self._held.values():
            while held.dispatched < len(held.segments):
                length = held.segments[held.dispatched].length
                if batch and used + length > budget:
                    return batch
                batch.append((held, held.dispatched))
                held.dispatched += 1
                used += length
        return batch

    async def _run_batch(self, batch: list[tuple[HeldJob, int]]) -> None:
        try:
            pcms = [read_segment(h.path, h.segments[i]) for h, i in batch]
        except OSError as exc:  # the blob vanished: most likely cancelled just now
            _undispatch(batch)
            await self._check()
            await self._fail_vanished(batch, exc)
            return
        audio_s = sum(len(p) for p in pcms) / SAMPLE_WIDTH / ENGINE_SAMPLE_RATE
        started = time.perf_counter()
        try:
            await self._decode_batch(batch, pcms)
        except REDIS_ERRORS:
            _undispatch(batch)  # decoded segments are kept; the rest go in a later batch
            raise
        except Exception as exc:  # an engine error costs the jobs in the batch an attempt
            await self._engine_failed(batch, exc)
            return
        except BaseException:
            _undispatch(batch)
            raise
        elapsed = time.perf_counter() - started
        self._observe_batch(audio_s, elapsed, len(pcms), len(_unique(h for h, _ in batch)))

    async def _decode_batch(self, batch: list[tuple[HeldJob, int]], pcms: list[bytes]) -> None:
        """Decode and record results; progress is written as each segment lands
        (after every segment with the default decode, after the call otherwise)."""
        if self._custom_decode is not None:
            hyps = await self._custom_decode(pcms)
            if len(hyps) != len(pcms):
                raise RuntimeError(f"decode returned {len(hyps)} results for {len(pcms)}")
            for (held, index), hyp in zip(batch, hyps, strict=True):
                held.results.append(to_segment(held.segments[index], hyp))
            for held in _unique(h for h, _ in batch):
                await self._write_progress(held)
            return
        step = metrics.STEP_DURATION.labels(lane=self.lane, worker=self.worker_id)
        for (held, index), pcm in zip(batch, pcms, strict=True):
            t0 = time.perf_counter()
            hyp = await self._decode_one(pcm)
            step.observe(time.perf_counter() - t0)
            held.results.append(to_segment(held.segments[index], hyp))
            await self._write_progress(held)

    async def _write_progress(self, held: HeldJob) -> None:
        if not held.ready and self._held.get(held.job_id) is held:
            await self.queue.progress(held.delivery, held.attempt, held.progress)

    async def _fail_vanished(self, batch: list[tuple[HeldJob, int]], exc: OSError) -> None:
        for held in _unique(h for h, _ in batch):
            if held.job_id in self._held:
                await self._fail(held.delivery, held.attempt, f"audio blob vanished: {exc}")

    async def _engine_failed(self, batch: list[tuple[HeldJob, int]], exc: Exception) -> None:
        reason = f"engine error: {type(exc).__name__}: {exc}"
        for held in _unique(h for h, _ in batch):
            self._held.pop(held.job_id, None)
            if await self.queue.release(held.delivery, held.attempt, count_attempt=True,
                                        error=reason):
                self.log.warning("job_retry", job_id=held.job_id, attempt=held.attempt,
                                 reason=reason)

    def _observe_batch(self, audio_s: float, elapsed: float, segments: int, jobs: int) -> None:
        labels = {"lane": self.lane, "worker": self.worker_id}
        metrics.AUDIO_SECONDS.labels(**labels).inc(audio_s)
        if audio_s > 0:
            metrics.REALTIME_FACTOR.labels(**labels).observe(elapsed / audio_s)
        self.log.info("batch_decoded", segments=segments, jobs=jobs,
                      audio_s=round(audio_s, 3), elapsed_s=round(elapsed, 3),
                      rtf=round(elapsed / audio_s, 4) if audio_s else None)

    # --- results ----------------------------------------------------------------------

    async def _store_ready(self) -> None:
        for held in [h for h in self._held.values() if h.ready]:
            transcript = Transcript.from_segments(held.results, held.audio_s, held.language)
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
        for seg in held.segments:
            metrics.SOFT_CUTS.labels(**labels, reason=seg.reason).inc()
        self._delete_audio(held.job_id)
        self.log.info("job_completed", job_id=held.job_id, attempt=held.attempt,
                      audio_s=round(held.audio_s, 3), duration_s=round(duration, 3),
                      segments=len(held.segments))

    # --- shutdown and liveness ----------------------------------------------------------

    async def _shutdown(self) -> None:
        """Store finished jobs and hand every other held job back (not an attempt)."""
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self._held and time.monotonic() < deadline:
            gave_up = asyncio.Event()
            if await self._guarded(gave_up, self._hand_back_all):
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

    async def engine_decode(self, pcms: list[bytes]) -> list[Hypothesis]:
        """The default decode as a ``Decode`` callable: one engine call per segment,
        each off the event loop (what a mixed worker can reuse)."""
        return [await self._decode_one(pcm) for pcm in pcms]

    async def _decode_one(self, pcm: bytes) -> Hypothesis:
        pieces: Callable[[bytes], Generator[Hypothesis | None, None, None]] | None = getattr(
            self.engine, "transcribe_segment_pieces", None)
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


def _undispatch(batch: list[tuple[HeldJob, int]]) -> None:
    """Segments of an interrupted batch that got no result go back to the pool."""
    for held in _unique(h for h, _ in batch):
        held.dispatched = len(held.results)


def _unique(items: Iterator[HeldJob] | Any) -> list[HeldJob]:
    seen: dict[int, HeldJob] = {}
    for item in items:
        seen.setdefault(id(item), item)
    return list(seen.values())


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


# --- the process ----------------------------------------------------------------------


def main(settings: Settings) -> int:
    """Run one batch worker process until SIGTERM/SIGINT; exit code."""
    worker_id = settings.worker_id or default_worker_id()
    configure_logging(settings.log_level, lane="batch", worker=worker_id)
    if not settings.redis_url:
        log.error("worker_no_redis", reason="LANEGATE_REDIS_URL is required for a worker")
        return 2
    return asyncio.run(_serve(settings.replace(worker_id=worker_id)))


async def _serve(settings: Settings) -> int:
    from workers.engines import create_engine

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine = await asyncio.to_thread(create_engine, settings, slots=0)
    redis = redis_client(settings.redis_url)
    consumer = BatchConsumer(settings, redis, engine)
    metrics.init_worker_series("batch", consumer.worker_id)
    runner, url = await _start_http(settings, consumer)
    tasks = [asyncio.create_task(_heartbeat(redis, settings, consumer, engine.name, url, stop))]
    log.info("worker_started", url=url, engine=engine.name)
    try:
        await consumer.run(stop)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(*REDIS_ERRORS):
            await registry.remove(redis, consumer.worker_id, "batch")
        await runner.cleanup()
        await redis.aclose()
    log.info("worker_stopped")
    return 0


async def _start_http(settings: Settings, consumer: BatchConsumer) -> tuple[web.AppRunner, str]:
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "worker": consumer.worker_id})

    async def readyz(_: web.Request) -> web.Response:
        status = 200 if consumer.ready else 503
        return web.json_response({"ready": consumer.ready, "held_jobs": consumer.held_jobs},
                                 status=status)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics.metrics_view)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.worker_host, settings.worker_port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else settings.worker_port
    host = settings.worker_advertise_host or settings.worker_host
    return runner, f"http://{host}:{port}"


async def _heartbeat(redis: aioredis.Redis, settings: Settings, consumer: BatchConsumer,
                     engine: str, url: str, stop: asyncio.Event) -> None:
    while not stop.is_set():
        info = registry.WorkerInfo(worker_id=consumer.worker_id, lane="batch", url=url,
                                   engine=engine, slots_total=0, slots_free=0,
                                   step_p99_ms=0.0)
        with contextlib.suppress(*REDIS_ERRORS):
            await registry.publish(redis, info, settings.heartbeat_ttl_s)
        await _wait(stop, settings.heartbeat_s)


if __name__ == "__main__":
    sys.exit(main(Settings.from_env()))
