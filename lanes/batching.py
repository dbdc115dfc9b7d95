"""Batching a batch worker's held jobs: the oldest jobs' next decode windows (VAD
segments joined, ``vad.windows``), across jobs, up to an audio budget (pure: no I/O,
like ``lanes.scheduler``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from engines.base import DecodeOptions, Task
from lanegate.constants import ENGINE_SAMPLE_RATE
from lanegate.transcript import Segment
from lanes.job_protocol import Delivery
from lanes.session import decode_options
from vad import Window


@dataclass(eq=False)
class HeldJob:
    """A job this worker is processing (one attempt)."""

    delivery: Delivery
    attempt: int
    language: str
    path: Path
    windows: list[Window]
    total_samples: int
    claimed_at: float  # time.monotonic()
    #: decoded alone, after every other held job (its last attempt failed, or it was in a
    #: batch that failed): a bad job is then charged alone
    isolated: bool = False
    dispatched: int = 0  # windows handed to a batch
    #: each decoded window's cues (one per VAD segment), in window order
    results: list[tuple[Segment, ...]] = field(default_factory=list)
    detected: list[str] = field(default_factory=list)  # the engine's language per window
    prompt: str = ""  # the decoder's initial prompt
    temperature: float | None = None  # None: the engine's default
    task: Task = Task.TRANSCRIBE  # TRANSLATE: English text (Whisper's translate task)

    @property
    def options(self) -> DecodeOptions:
        """The decoder options its windows are decoded with ("" language: detected)."""
        return decode_options(self.language, self.prompt, self.temperature, self.task)

    @property
    def result_language(self) -> str:
        """The job's language, or the one the engine detected most (no language given)."""
        found = [lang for lang in self.detected if lang]
        if self.language or not found:
            return self.language
        return max(set(found), key=found.count)

    @property
    def job_id(self) -> str:
        return self.delivery.job_id

    @property
    def ready(self) -> bool:
        return len(self.results) == len(self.windows)

    @property
    def remaining_s(self) -> float:
        left = sum(w.length for w in self.windows[self.dispatched:])
        return left / ENGINE_SAMPLE_RATE

    @property
    def progress(self) -> float:
        if not self.results or self.total_samples <= 0:
            return 0.0
        done = self.windows[len(self.results) - 1].end
        return min(1.0, done / self.total_samples)

    @property
    def text_so_far(self) -> str:
        """The decoded cues' text, in order (results land in window order)."""
        return " ".join(s.text for s in self.cues if s.text)

    @property
    def cues(self) -> list[Segment]:
        """Every decoded window's cues, in order."""
        return [cue for cues in self.results for cue in cues]

    @property
    def audio_s(self) -> float:
        return self.total_samples / ENGINE_SAMPLE_RATE


#: (job, index of one of its segments) pairs, decoded in one engine call
Batch = list[tuple[HeldJob, int]]


def next_batch(held: Iterable[HeldJob], budget_samples: float) -> Batch:
    """The oldest held jobs' next windows, up to ``budget_samples`` (at least one);
    each is marked dispatched. Isolated jobs wait until no other job has windows
    left, then go one job per batch."""
    waiting = [job for job in held if job.dispatched < len(job.windows)]
    pool = [job for job in waiting if not job.isolated] or waiting[:1]
    batch: Batch = []
    used = 0
    for job in pool:
        while job.dispatched < len(job.windows):
            length = job.windows[job.dispatched].length
            if batch and used + length > budget_samples:
                return batch
            batch.append((job, job.dispatched))
            job.dispatched += 1
            used += length
    return batch


def undispatch(batch: Batch) -> None:
    """Segments of an interrupted batch that got no result go back to the pool."""
    for job in jobs_of(batch):
        job.dispatched = len(job.results)


def jobs_of(batch: Batch) -> list[HeldJob]:
    """The jobs with a segment in ``batch``, each once, in batch order."""
    seen: dict[int, HeldJob] = {}
    for job, _ in batch:
        seen.setdefault(id(job), job)
    return list(seen.values())
