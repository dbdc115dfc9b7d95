"""The realtime lane's step loop: plan a step, run it off the event loop, send events.

Engine calls run in a single-thread executor so that, between steps, the event
loop serves network I/O (pocketsphinx holds the GIL during a call, so a step
still blocks the loop while it runs; the plan keeps each step short). Session
lifecycle (finish, start, close) happens only here between steps, never while
a step that uses the stream is in flight. In mixed mode whole batch-lane
decodes run in the same loop, in one piece, between realtime steps.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engines.base import DEFAULT_OPTIONS, CostPrior, DecodeOptions, Engine, Hypothesis
from lanegate import metrics
from lanegate.constants import CLOSE_INTERNAL, CLOSE_NORMAL, ENGINE_SAMPLE_RATE
from lanegate.logs import get_logger
from lanegate.settings import Settings
from lanes.cost import CostModel, percentile
from lanes.scheduler import (
    Candidate,
    OldestPendingFirstQueue,
    StepLimits,
    StepPlan,
    plan_step,
)
from lanes.session import VAD_STEP_SAMPLES, Event, RealtimeSession

# Recent step durations kept for the heartbeat's p99.
RECENT_STEPS = 512
# Upper bound on an idle wait, so a missed wake-up can never stall a session.
IDLE_WAIT_S = 0.5


@dataclass(frozen=True)
class Close:
    """Outbox item: close the WebSocket with this code."""

    code: int


@dataclass
class SessionHandle:
    """A session in the loop and where its events go: ``sink`` if given (a shared
    connection that batches many sessions' events), else the ``outbox`` queue."""

    session: RealtimeSession
    sink: Callable[[Event | Close], None] | None = None
    outbox: asyncio.Queue[Event | Close] = field(default_factory=asyncio.Queue)
    abandoned: bool = False  # the connection is gone or broke the protocol
    started: float = field(default_factory=time.monotonic)

    def post(self, item: Event | Close) -> None:
        if self.sink is not None:
            self.sink(item)
        else:
            self.outbox.put_nowait(item)

    def send(self, events: Sequence[Event]) -> None:
        if not self.abandoned:
            for event in events:
                self.post(event)


@dataclass
class BatchItem:
    segments: list[bytes]
    future: asyncio.Future[list[Hypothesis]]
    options: DecodeOptions = DEFAULT_OPTIONS


def step_limits(settings: Settings, lane: str, prior: CostPrior | None = None) -> StepLimits:
    """The cap of ``lane``; a re-decoding engine (its ``prior`` says) has its own budget."""
    redecodes = prior is not None and prior.redecodes
    budget_ms = settings.step_budget(redecodes=redecodes)
    return StepLimits(
        max_chunk_samples=settings.max_chunk_ms * ENGINE_SAMPLE_RATE // 1000,
        budget_s=budget_ms / 1000,
        capped=settings.chunk_cap and lane != "mixed",
        sample_rate=ENGINE_SAMPLE_RATE,
    )


class StepLoop:
    def __init__(self, engine: Engine, settings: Settings, *, lane: str, worker_id: str) -> None:
        self.engine = engine
        self.lane = lane
        self.worker_id = worker_id
        self.sessions: dict[str, SessionHandle] = {}
        # Per iteration only sessions that changed are settled, and a session's
        # candidate is computed only then: a session changes only when touched
        # (audio, end) or stepped. Visiting every session every iteration made an
        # iteration O(sessions), and a worker that fell behind, with every session
        # waiting, spent its time planning instead of decoding.
        self._dirty: dict[str, None] = {}  # touched or stepped since last settled
        self._ready: dict[str, Candidate] = {}  # sessions with decodable audio
        self.cost = CostModel.from_prior(engine.cost_prior(), settings.cost_ewma_alpha)
        self.limits = step_limits(settings, lane, engine.cost_prior())
        # Uncapped (the naive designs) the VAD also takes a burst in one piece.
        self.vad_slice_samples = VAD_STEP_SAMPLES if self.limits.capped else 2**62
        self.queue = OldestPendingFirstQueue()
        self.step_times: deque[float] = deque(maxlen=RECENT_STEPS)
        self.steps = 0
        #: monotonic time the engine call of the realtime step in flight began (a
        #: watchdog reads it); None between steps
        self.step_started: float | None = None
        self._in_step: frozenset[str] = frozenset()  # the sessions the step in flight holds
        self._batch: deque[BatchItem] = deque()
        self._wake = asyncio.Event()
        self.idle = asyncio.Event()  # set while no session is active
        self.idle.set()
        self._flush_all = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._log = get_logger("lanegate.steploop", lane=lane, worker=worker_id)
        self._labels = {"lane": lane, "worker": worker_id}

    @property
    def stepping(self) -> bool:
        """A realtime step is running in the executor."""
        return self.step_started is not None

    # --- inputs (called from connection handlers) ---------------------------------
    def add(self, session: RealtimeSession,
            sink: Callable[[Event | Close], None] | None = None) -> SessionHandle:
        handle = SessionHandle(session, sink)
        self.sessions[session.session_id] = handle
        self._gauges()
        self.touch(handle)
        return handle

    def wake(self) -> None:
        self._wake.set()

    def touch(self, handle: SessionHandle) -> None:
        """``handle``'s session changed (audio, end, abandoned, stepped): settle it next
        iteration."""
        self._dirty[handle.session.session_id] = None
        self.wake()

    def reclaim(self) -> int:
        """Drop now the abandoned sessions that the step in flight does not hold, rather
        than at the next settle, and return how many: their slots are free for an
        ``open`` that arrived right behind their ``abandon`` (a client that reconfigures
        a session on a full worker), before this loop ran again."""
        done = [h for sid, h in self.sessions.items()
                if h.abandoned and sid not in self._in_step]
        for handle in done:
            self._drop(handle, "abandoned")
        return len(done)

    def flush_all(self) -> None:
        """Drain deadline: every session gets its last finals and ``done`` now."""
        self._flush_all = True
        self.wake()

    async def submit_batch(self, segments: list[bytes],
                           options: DecodeOptions = DEFAULT_OPTIONS) -> list[Hypothesis]:
        """Mixed mode: decode these segments (one job's decoder options) in one uncapped
        work item of this loop."""
        item = BatchItem(segments, asyncio.get_running_loop().create_future(), options)
        self._batch.append(item)
        self.wake()
        return await item.future

    def step_p99_ms(self) -> float:
        return percentile(self.step_times, 0.99) * 1000

    # --- the loop ------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                self._wake.clear()
                self._settle_dirty()
                plan = plan_step(self._candidates(), self.queue, self.cost, self.limits)
                if plan:
                    await self._run_step(plan)
                if self._batch:
                    await self._run_batch_item(self._batch.popleft())
                if not plan and not self._batch and not self._dirty:
                    await self._idle(stop)
                else:
                    await asyncio.sleep(0)  # let network I/O in between steps
        finally:
            self._close_all()
            self._executor.shutdown(wait=True)

    async def _idle(self, stop: asyncio.Event) -> None:
        stopper = asyncio.ensure_future(stop.wait())
        waker = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({stopper, waker}, timeout=IDLE_WAIT_S,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            waker.cancel()

    def _settle_dirty(self) -> None:
        """Settle every touched session (all of them at the drain deadline); one whose
        VAD still has a burst to analyse stays dirty for the next iteration."""
        dirty = self.sessions if self._flush_all else self._dirty
        self._dirty = {}
        now = time.monotonic()
        for session_id in list(dirty):
            handle = self.sessions.get(session_id)
            if handle is None:
                continue
            if handle.abandoned:
                self._drop(handle, "abandoned")
                continue
            try:
                self._settle(handle, now)
            except Exception:  # one session's failure must not stop the others
                self._log.exception("session_failed", session_id=session_id)
                self._fail(handle, "the worker failed on this session")
                self._drop(handle, "failed")
                continue
            if session_id in self.sessions:
                self._update_candidate(handle)

    def _update_candidate(self, handle: SessionHandle) -> None:
        session = handle.session
        candidate = session.candidate()
        if candidate.pending_samples > 0:
            self._ready[session.session_id] = candidate
        else:
            self._ready.pop(session.session_id, None)
        if session.analysis_pending:
            self._dirty[session.session_id] = None

    def _candidates(self) -> list[Candidate]:
        return list(self._ready.values())

    def _settle(self, handle: SessionHandle, now: float) -> None:
        session = handle.session
        session.analyse(self.vad_slice_samples)
        if self._flush_all:
            session.end(now)
            handle.send(self._counted(session.flush_now()))
        handle.send(self._counted(session.settle()))
        if session.finished:
            handle.send([{"type": "done"}])
            handle.post(Close(CLOSE_NORMAL))
            self._drop(handle, "done")

    async def _run_step(self, plan: StepPlan) -> None:
        handles = [self.sessions[c.session_id] for c in plan.chunks]
        work = [(h.session.stream, h.session.take(c.samples))
                for h, c in zip(handles, plan.chunks, strict=True)]
        started = time.perf_counter()
        self.step_started = time.monotonic()
        self._in_step = frozenset(c.session_id for c in plan.chunks)
        try:
            hyps = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.engine.step, work)
        except Exception:
            self._log.exception("step_failed", sessions=len(work))
            for handle in handles:
                self._fail(handle, "the engine failed on this session's audio")
            return
        finally:
            self.step_started = None
            self._in_step = frozenset()
        self._record_step(time.perf_counter() - started, plan.audio_samples, len(work),
                          learn=True)
        now = time.monotonic()
        for handle, hyp in zip(handles, hyps, strict=True):
            self.touch(handle)
            try:
                handle.send(self._counted(handle.session.after_chunk(hyp, now)))
            except Exception:
                self._log.exception("session_failed", session_id=handle.session.session_id)
                self._fail(handle, "the worker failed on this session")

    async def _run_batch_item(self, item: BatchItem) -> None:
        live_streams = len(self.sessions)  # none of them steps until the item is done
        started = time.perf_counter()
        try:
            hyps = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.engine.transcribe_batch, item.segments, item.options)
        except Exception as exc:
            if not item.future.done():
                item.future.set_exception(exc)
            return
        samples = sum(len(s) for s in item.segments) // 2
        elapsed = time.perf_counter() - started
        self._record_step(elapsed, samples, 0)
        metrics.record_long_prefill(self._labels, elapsed, live_streams)
        if not item.future.done():
            item.future.set_result(hyps)

    def _record_step(self, seconds: float, samples: int, seqs: int, *,
                     learn: bool = False) -> None:
        audio_s = samples / ENGINE_SAMPLE_RATE
        profile = self.engine.last_profile()
        if learn and profile is not None:
            self.cost.observe_profile(seconds, profile)
        elif learn and seqs:
            self.cost.observe(seconds, audio_s, seqs)
        self.step_times.append(seconds)
        self.steps += 1
        metrics.STEP_DURATION.labels(**self._labels).observe(seconds)
        metrics.AUDIO_SECONDS.labels(**self._labels).inc(audio_s)
        if audio_s > 0:
            metrics.REALTIME_FACTOR.labels(**self._labels).observe(seconds / audio_s)

    def _counted(self, events: list[Event]) -> list[Event]:
        for event in events:
            if event["type"] == "final":
                metrics.SOFT_CUTS.labels(**self._labels, reason=event["cut"]).inc()
        return events

    def _fail(self, handle: SessionHandle, message: str) -> None:
        handle.send([{"type": "error", "code": "internal", "message": message}])
        handle.post(Close(CLOSE_INTERNAL))
        handle.abandoned = True
        self.touch(handle)

    def _drop(self, handle: SessionHandle, reason: str) -> None:
        session = handle.session
        self.sessions.pop(session.session_id, None)
        self._ready.pop(session.session_id, None)
        try:
            session.close()
        except Exception:  # the slot is lost, the worker is not
            self._log.exception("slot_close_failed", session_id=session.session_id)
        self._gauges()
        self._log.info("session_end", session_id=session.session_id, reason=reason,
                       audio_s=round(session.audio_received_s, 3), finals=session.segment,
                       duration_s=round(time.monotonic() - handle.started, 3))

    def _close_all(self) -> None:
        for handle in list(self.sessions.values()):
            handle.post(Close(CLOSE_NORMAL))
            self._drop(handle, "worker_stopped")
        for item in self._batch:
            if not item.future.done():
                item.future.set_exception(RuntimeError("the worker is stopping"))
        self._batch.clear()

    def _gauges(self) -> None:
        metrics.ACTIVE_SESSIONS.labels(**self._labels).set(len(self.sessions))
        if self.sessions:
            self.idle.clear()
        else:
            self.idle.set()
        metrics.FREE_SLOTS.labels(**self._labels).set(self.engine.slots_free())

    def stats(self) -> dict[str, Any]:
        return {"steps": self.steps, "step_p99_ms": round(self.step_p99_ms(), 2),
                "cost_s_per_audio_s": round(self.cost.s_per_audio_s, 4)}
