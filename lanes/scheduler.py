"""The realtime lane scheduler: which audio each engine step decodes.

vLLM-v1 style: a queue policy orders the sessions that have pending audio, and
the pure function ``plan_step`` fills one step from that order. With the cap
on, each session gives at most ``max_chunk`` samples and the step stops adding
work once its estimated cost reaches the budget; the last chunk is shrunk to
what the budget still affords. A step always holds at least one chunk, so
progress is guaranteed even when one chunk alone costs more than the budget.
Without the cap (``split-nocap``, ``mixed``) every session's whole pending
audio goes into the step.

A re-decoding engine (Whisper) encodes a session's whole current segment each
step, so its cost is set by the segment, not by the chunk: each session in the
step takes all its pending audio up to its next cut, and the budget bounds the
step's encoder frames (every sequence padded to the longest) and expected
decoder tokens; sessions are added, in the queue's order, while the estimate
stays within the budget. A decode for good (a segment's final, or a finished
piece of a long one) and a partial's decode never share a step: the first
session in the queue's order says which kind the step is, and only sessions of
that kind join it. On a CPU a step lasts as long as its longest generation, so a
partial that shared a step with another session's final or piece waited for it
(two streams of the shared recording: partial p99 1,089-1,263 ms with them
together, 451-506 ms apart).
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
    context_samples: int = 0  # already in the engine's current segment (a re-decode's too)
    #: its decode is for good (a re-decoding engine's final or sealed piece): no partial
    for_good: bool = False


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


def plan_step(candidates: Sequence[Candidate], queue: SchedulingQueue, cost: CostModel,
              limits: StepLimits) -> StepPlan:
    """The chunks of the next step (pure: reads its arguments, changes nothing)."""
    waiting = [c for c in candidates if c.pending_samples > 0]
    if not waiting:
        return EMPTY_PLAN
    if not limits.capped:
        return _plan(tuple(Chunk(c.session_id, c.pending_samples) for c in waiting), cost,
                     limits, waiting)
    if cost.redecode is not None:
        return _plan_redecode(queue.order(waiting, limits.max_chunk_samples), cost, limits)
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


def _plan_redecode(ordered: Sequence[Candidate], cost: CostModel,
                   limits: StepLimits) -> StepPlan:
    """Whole pending audio per session, sessions added while the step fits the budget;
    only sessions whose decode is of the first one's kind (for good, or a partial)."""
    chunks: list[Chunk] = []
    frames = 0
    estimate = 0.0
    kind = ordered[0].for_good
    for cand in ordered:
        if cand.for_good is not kind:
            continue
        need = max(frames, redecode_frames(cand, cand.pending_samples, cost))
        more = cost.redecode_estimate_s(len(chunks) + 1, need)
        if chunks and more > limits.budget_s:
            break
        chunks.append(Chunk(cand.session_id, cand.pending_samples))
        frames, estimate = need, more
    return StepPlan(tuple(chunks), sum(c.samples for c in chunks), estimate)


def redecode_frames(cand: Candidate, take: int, cost: CostModel) -> int:
    """Encoder frames (10 ms) of a session's re-decode after taking ``take`` samples."""
    pad = cost.redecode.pad_frames if cost.redecode is not None else 0
    return (cand.context_samples + take) // GRANULE_SAMPLES + pad


def _plan(chunks: tuple[Chunk, ...], cost: CostModel, limits: StepLimits,
          candidates: Sequence[Candidate] = ()) -> StepPlan:
    audio = sum(c.samples for c in chunks)
    if cost.redecode is not None and candidates:
        frames = max(redecode_frames(c, c.pending_samples, cost) for c in candidates)
        return StepPlan(chunks, audio, cost.redecode_estimate_s(len(chunks), frames))
    return StepPlan(chunks, audio, cost.estimate_s(audio / limits.sample_rate, len(chunks)))
