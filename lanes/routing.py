"""Lane routing for uploads: transcribe now on the realtime lane, or queue a batch job.

:func:`route_upload` is the whole rule. A short upload that asks for no job is
fed to a realtime worker in capped chunks, like a stream, and answered at once;
anything longer, marked async or carrying a webhook (a webhook only exists for
jobs), becomes a job on the batch lane's Redis stream, and so does a short one
while the realtime lane has no slot to spare. The OpenAI endpoint has no
"async": long audio still goes to the batch lane and the request waits for the
job, so a long prefill never lands on the realtime lane.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from lanegate.settings import Settings


class Lane(enum.StrEnum):
    REALTIME = "realtime"
    BATCH = "batch"


class Reason(enum.StrEnum):
    SHORT = "short"  # at most sync_max_seconds: realtime lane
    LONG = "long"  # longer than sync_max_seconds: batch lane
    ASYNC = "async"  # the client asked for a job
    REALTIME_BUSY = "realtime_busy"  # no realtime slot free: fell back to the batch lane


@dataclass(frozen=True)
class Route:
    lane: Lane
    reason: Reason

    @property
    def sync(self) -> bool:
        return self.lane is Lane.REALTIME


def route_upload(audio_seconds: float, *, async_requested: bool, free_realtime_slots: int,
                 settings: Settings, webhook: bool = False) -> Route:
    """The lane for an upload of ``audio_seconds`` of decoded audio.

    ``free_realtime_slots`` counts the non-draining realtime workers' free slots
    (from the registry); ``webhook``: the client gave a ``webhook_url``.
    """
    if async_requested or webhook:
        return Route(Lane.BATCH, Reason.ASYNC)
    if audio_seconds > settings.sync_max_seconds:
        return Route(Lane.BATCH, Reason.LONG)
    if not realtime_admits(free_realtime_slots, settings):
        return busy_fallback()
    return Route(Lane.REALTIME, Reason.SHORT)


def busy_fallback() -> Route:
    """The route when the realtime lane has no slot to spare, or refused the session
    once asked (the API key's session limit, no worker took it, the worker was lost)."""
    return Route(Lane.BATCH, Reason.REALTIME_BUSY)


def realtime_admits(free_slots: int, settings: Settings) -> bool:
    """Whether a short upload may take a realtime slot: only while more than
    ``upload_reserve_slots`` are free, so uploads never take the last ones from live
    streams (the upload then becomes a batch job)."""
    return free_slots > settings.upload_reserve_slots


def wait_timeout_s(audio_seconds: float, settings: Settings) -> float:
    """How long a request may wait for its transcript (realtime session or batch job)."""
    return settings.wait_base_s + settings.wait_per_audio_s * audio_seconds
