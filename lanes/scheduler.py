"""The realtime lane scheduler: which audio each engine step decodes.

vLLM-v1 style: a queue policy orders the sessions that have pending audio, and
the pure function ``plan_step`` fills one step from that order. With the cap
on, each session gives at most ``max_chunk`` samples and the step stops adding
work once its estimated cost reaches the budget; the last chunk is shrunk to
what the budget still affords. A step always holds at least one chunk, so
progress is guaranteed even when one chunk alone costs more than the budget.
Without the cap (``split-nocap``, ``mixed``) every session's whole pending
audio goes into the step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from lanes.cost import CostModel

# Chunks are whole 10 ms frames at 16 kHz, except a session's last few samples.
GRANULE_SAMPLES = 160


@dataclass(frozen=True)
class Candidate:
    """A session as the planner sees it."""

    session_id: str
    pending_samples: int  # decodable now (up to the session's next cut)
    oldest_pending_at: float  # paced arrival time (monotonic) of the oldest pending sample


@dataclass(frozen=True)
class Chunk:
    session_id: str
    samples: int


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[Chunk, ...]
    audio_samples: int
    estimated_s: float

    def __bool__(self) -> bool:
        return bool(self.chunks)


EMPTY_PLAN = StepPlan((), 0, 0.0)


@dataclass(frozen=True)
class StepLimits:
    max_chunk_samples: int
    budget_s: float
    capped: bool = True
    sample_rate: int = 16000


class SchedulingQueue(Protocol):
    """A policy: the order in which sessions are offered room in a step."""

    name: str

    def order(self, candidates: Iterable[Candidate], max_chunk_samples: int) -> list[Candidate]:
        ...


class OldestPendingFirstQueue:
    """Oldest pending audio first (earliest deadline first).

    Sessions age their audio at real-time pace (see ``RealtimeSession``), so a
    10 s burst is not ten seconds 'older' than the live streams: it is served
    ahead of them only once it has fallen behind real time.
    """

    name = "oldest_pending_first"

    def order(self, candidates: Iterable[Candidate], max_chunk_samples: int) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (c.oldest_pending_at, c.session_id))


class StallFreeQueue:
    """Sessions on their beat first, then backlogs, each group oldest pending first.

    A session whose pending audio fits in one chunk is a live stream keeping up
    (an LLM 'decode'); one with more is digesting a backlog (a 'prefill'). As in
    Sarathi-Serve's stall-free batching, backlogs only fill the budget the beat
    sessions leave. A live stream that falls behind by more than a chunk joins
    the backlogs, so under overload this is no fairer than oldest-first.
    """

    name = "stall_free"

    def order(self, candidates: Iterable[Candidate], max_chunk_samples: int) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (c.pending_samples > max_chunk_samples,
                                                 c.oldest_pending_at, c.session_id))


QUEUES: dict[str, type[OldestPendingFirstQueue] | type[StallFreeQueue]] = {
    OldestPendingFirstQueue.name: OldestPendingFirstQueue,
    StallFreeQueue.name: StallFreeQueue,
}


def create_queue(name: str = OldestPendingFirstQueue.name) -> SchedulingQueue:
    try:
        return QUEUES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling queue {name!r}; use one of {sorted(QUEUES)}") \
            from None


def plan_step(candidates: Sequence[Candidate], queue: SchedulingQueue, cost: CostModel,
              limits: StepLimits) -> StepPlan:
    """The chunks of the next step (pure: reads its arguments, changes nothing)."""
    waiting = [c for c in candidates if c.pending_samples > 0]
    if not waiting:
        return EMPTY_PLAN
    if not limits.capped:
        return _plan(tuple(Chunk(c.session_id, c.pending_samples) for c in waiting), cost,
                     limits)
    chunks: list[Chunk] = []
    audio = 0
    for cand in queue.order(waiting, limits.max_chunk_samples):
        take = _chunk_size(cand, audio, len(chunks), cost, limits)
        if take == 0:
            break
        chunks.append(Chunk(cand.session_id, take))
        audio += take
    return _plan(tuple(chunks), cost, limits)


def _chunk_size(cand: Candidate, audio: int, seqs: int, cost: CostModel,
                limits: StepLimits) -> int:
    """Whole chunk if it fits, else what the budget affords, else nothing; but the
    first chunk of a step is never nothing."""
    want = min(cand.pending_samples, limits.max_chunk_samples)
    affordable = _affordable(audio, seqs, cost, limits)
    if want <= affordable:
        return want
    if affordable >= GRANULE_SAMPLES:
        return affordable
    return want if seqs == 0 else 0


def _affordable(audio: int, seqs: int, cost: CostModel, limits: StepLimits) -> int:
    """Samples one more chunk may hold, in whole frames."""
    room_s = cost.affordable_audio_s(limits.budget_s, seqs + 1) - audio / limits.sample_rate
    if room_s == float("inf"):
        return limits.max_chunk_samples
    samples = int(max(0.0, room_s) * limits.sample_rate)
    return samples // GRANULE_SAMPLES * GRANULE_SAMPLES


def _plan(chunks: tuple[Chunk, ...], cost: CostModel, limits: StepLimits) -> StepPlan:
    audio = sum(c.samples for c in chunks)
    return StepPlan(chunks, audio, cost.estimate_s(audio / limits.sample_rate, len(chunks)))
