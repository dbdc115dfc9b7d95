"""The worker side of the batch lane: stream mechanics and job transitions.

One consumer group (``JOB_GROUP``) reads ``JOB_STREAM``. A worker owns a job
for one *attempt*: ``start`` bumps the job's ``attempts`` and every later write
(progress, result, failure, hand-back) is accepted only while the job is still
``processing`` with that same attempt number. So when a slow or dead worker's
entry is reclaimed (``XAUTOCLAIM`` after ``claim_idle_s``) and started by
another worker, the old owner's writes are refused: one result per job.

Every transition is one Lua script (``lanes.job_protocol``) that changes the job
hash, the stream (``XACK`` + ``XDEL``: a finished entry leaves the stream), the
dead-letter stream and the webhook queue together. The result is written with ``SET NX``
before the entry is acknowledged.

A live worker keeps its entries from being reclaimed with ``touch``
(``XCLAIM ... JUSTID`` resets their idle time, only for entries it still owns).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from lanegate.constants import (
    DEAD_LETTER_STREAM,
    FAIR_RING_KEY,
    FAIR_WAITING_KEY,
    JOB_GROUP,
    JOB_KEY,
    JOB_STREAM,
    RESULT_KEY,
    WEBHOOK_DUE_KEY,
    WEBHOOK_KEY,
)
from lanegate.redis_io import decode_hash, text, ttl_ms
from lanegate.settings import Settings
from lanegate.transcript import Transcript
from lanes.job_protocol import TRANSITIONS, Delivery, Job, JobStatus, Outcome, Standing

#: most XAUTOCLAIM calls one ``reclaim`` makes while scanning the pending list
_RECLAIM_SCAN_CALLS = 100


@dataclass(frozen=True)
class Started:
    """What ``start`` decided (``Outcome``), with the attempt number when it runs."""

    outcome: Outcome
    attempt: int = 0
    first: bool = False  # the job's first start (queue wait ends here)
    reason: str = ""
    job: Job | None = None


def _entries(reply: Any) -> list[tuple[str, dict[str, str] | None]]:
    """(id, fields) pairs of an XREADGROUP / XAUTOCLAIM reply (RESP2 or RESP3)."""
    out: list[tuple[str, dict[str, str] | None]] = []
    for entry_id, fields in reply or []:
        out.append((text(entry_id), decode_hash(fields) if fields else None))
    return out


def _streams(reply: Any) -> list[Any]:
    if isinstance(reply, dict):
        return [entries for entries in reply.values()]
    return [entries for _, entries in reply or []]


#: most undelivered entries ``backlog`` counts one by one (beyond it: the group's lag)
_BACKLOG_XRANGE_CAP = 10_000


def _id_ms(entry_id: object) -> int:
    return int(text(entry_id).split("-", 1)[0])


@dataclass(frozen=True)
class Backlog:
    depth: int  # undelivered plus delivered-not-acknowledged entries
    oldest_ms: int | None  # XADD time of the oldest such entry (its id), None when empty

    def oldest_age_s(self, now: float | None = None) -> float:
        if self.oldest_ms is None:
            return 0.0
        now_ms = (time.time() if now is None else now) * 1000.0
        return max(0.0, (now_ms - self.oldest_ms) / 1000.0)


async def fair_waiting(redis: Any) -> int:
    """Jobs still in their tenants' fair-scheduling lists (not yet on the stream)."""
    tenants = [text(t) for t in await redis.lrange(FAIR_RING_KEY, 0, -1)]
    if not tenants:
        return 0
    async with redis.pipeline(transaction=False) as pipe:
        for tenant in tenants:
            pipe.llen(FAIR_WAITING_KEY.format(tenant=tenant))
        return sum(int(n) for n in await pipe.execute())


async def backlog(redis: Any) -> Backlog:
    """The batch lane's backlog: jobs waiting in their tenants' lists, entries the group
    has not delivered and those it has delivered and not acknowledged; the oldest age
    comes from the entry ids (a waiting job is younger than the stream's entries of
    its tenant, though not always of others)."""
    before = await fair_waiting(redis)
    try:
        groups = await redis.xinfo_groups(JOB_STREAM)
    except ResponseError:  # no stream yet
        groups = []
    for group in groups:
        if text(group.get("name", "")) != JOB_GROUP:
            continue
        pending = int(group.get("pending") or 0)
        last = text(group.get("last-delivered-id") or "0-0")
        undelivered = await redis.xrange(
            JOB_STREAM, min="(" + last, max="+", count=_BACKLOG_XRANGE_CAP
        )
        # Counted, not the group's `lag`: finished entries are XDELed, and Redis's lag
        # estimate can still include deleted entries. Beyond the cap, lag is the estimate.
        lag = group.get("lag")
        waiting = len(undelivered)
        if waiting >= _BACKLOG_XRANGE_CAP and lag is not None:
            waiting = max(waiting, int(lag))
        oldest_ms = _id_ms(undelivered[0][0]) if undelivered else None
        if pending:
            summary = await redis.xpending(JOB_STREAM, JOB_GROUP)
            if summary.get("min"):
                first = _id_ms(summary["min"])
                oldest_ms = first if oldest_ms is None else min(oldest_ms, first)
        return Backlog(depth=before + pending + waiting, oldest_ms=oldest_ms)
    # no worker has created the group yet: every entry is undelivered
    first = await redis.xrange(JOB_STREAM, count=1)
    if not first:
        return Backlog(depth=before, oldest_ms=None)
    return Backlog(depth=before + int(await redis.xlen(JOB_STREAM)),
                   oldest_ms=_id_ms(first[0][0]))


class JobQueue:
    """A batch worker's handle on the job stream, as consumer ``consumer``."""

    def __init__(self, redis: aioredis.Redis, settings: Settings, consumer: str) -> None:
        self.redis = redis
        self.settings = settings
        self.consumer = consumer
        self._autoclaim_cursor = "0-0"
        self._scripts = {name: redis.register_script(src) for name, src in TRANSITIONS.items()}

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream) if missing: reads from id 0."""
        try:
            await self.redis.xgroup_create(JOB_STREAM, JOB_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # --- getting entries ----------------------------------------------------------

    async def feed(self, want: int = 1) -> int:
        """Move waiting jobs onto the stream, round-robin across tenants, until it holds
        ``batch_fair_window`` (or ``want``) undelivered entries; how many moved."""
        window = max(1, want, self.settings.batch_fair_window)
        return int(await self._scripts["feed"](
            keys=[JOB_STREAM, FAIR_RING_KEY], args=[JOB_GROUP, window, repr(time.time())]))

    async def read(self, count: int = 1, block_ms: int | None = None) -> list[Delivery]:
        """New entries (``>``), after a ``feed``; blocks up to ``block_ms`` when given."""
        await self.feed(count)
        reply = await self.redis.xreadgroup(
            JOB_GROUP, self.consumer, {JOB_STREAM: ">"}, count=count, block=block_ms
        )
        return await self._deliveries(
            [e for entries in _streams(reply) for e in _entries(entries)]
        )

    async def read_own_pending(self, count: int = 100) -> list[Delivery]:
        """Entries already pending for this consumer name (a restarted worker's)."""
        reply = await self.redis.xreadgroup(
            JOB_GROUP, self.consumer, {JOB_STREAM: "0"}, count=count
        )
        return await self._deliveries(
            [e for entries in _streams(reply) for e in _entries(entries)]
        )

    async def reclaim(self, count: int = 1) -> list[Delivery]:
        """Entries idle for ``claim_idle_s`` in any consumer (a dead worker's).

        Scans the whole pending list if need be (XAUTOCLAIM looks at about
        ``10 x count`` entries per call) and remembers where it stopped."""
        for _ in range(_RECLAIM_SCAN_CALLS):
            reply = await self.redis.xautoclaim(
                JOB_STREAM, JOB_GROUP, self.consumer,
                min_idle_time=int(self.settings.claim_idle_s * 1000),
                start_id=self._autoclaim_cursor, count=count,
            )
            self._autoclaim_cursor = text(reply[0])
            found = await self._deliveries(_entries(reply[1]))
            if found or self._autoclaim_cursor == "0-0":
                return found
        return []

    async def _deliveries(
        self, entries: list[tuple[str, dict[str, str] | None]]
    ) -> list[Delivery]:
        out: list[Delivery] = []
        for entry_id, fields in entries:
            if not fields or "job_id" not in fields:  # deleted under us: forget it
                await self.redis.xack(JOB_STREAM, JOB_GROUP, entry_id)
                continue
            out.append(Delivery.from_entry(entry_id, fields))
        return out

    async def touch(self, entry_ids: list[str]) -> set[str]:
        """Reset the idle time of the entries this consumer still owns; returns them."""
        if not entry_ids:
            return set()
        owned = await self._scripts["touch"](
            keys=[JOB_STREAM], args=[JOB_GROUP, self.consumer, *entry_ids]
        )
        return {text(e) for e in owned}

    # --- transitions --------------------------------------------------------------

    async def start(self, d: Delivery) -> Started:
        reply = await self._run("start", d, self.consumer, self.settings.max_attempts)
        outcome = Outcome(text(reply[0]))
        if outcome is Outcome.RUN:
            job = await self.job(d.job_id)
            return Started(outcome, int(text(reply[1])), text(reply[2]) == "1", job=job)
        return Started(outcome, reason=text(reply[1]))

    async def progress(self, d: Delivery, attempt: int, progress: float,
                       text: str = "") -> bool:
        """Record progress and the text of the segments decoded so far (in order: a
        streamed transcription follows it)."""
        return bool(await self._run("progress", d, attempt, f"{progress:.4f}", text))

    async def complete(self, d: Delivery, attempt: int, transcript: Transcript) -> bool:
        """Store the result (SET NX) and acknowledge; False if no longer ours. A job
        asked for no language takes the result's (the detected one)."""
        return bool(await self._run("complete", d, attempt, transcript.to_json(),
                                    transcript.language))

    async def fail(self, d: Delivery, attempt: int, reason: str) -> bool:
        """Fail the job now (no retry) and acknowledge; False if no longer ours."""
        return bool(await self._run("fail", d, attempt, reason))

    async def release(self, d: Delivery, attempt: int, *, count_attempt: bool,
                      error: str = "") -> bool:
        """Hand the job back: re-queued on a new entry, this one acknowledged.
        ``count_attempt=False`` (a clean shutdown) gives the attempt back."""
        return bool(await self._run("release", d, attempt,
                                    "1" if count_attempt else "0", error))

    async def drop(self, d: Delivery) -> None:
        """Acknowledge and delete an entry whose job needs no more work."""
        await self._run("drop", d)

    async def states(self, owned: dict[str, int]) -> dict[str, Standing]:
        """For job id -> attempt: where each held job stands now."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in owned:
                pipe.hmget(JOB_KEY.format(job_id=job_id), ["status", "attempts"])
            replies = await pipe.execute()
        out: dict[str, Standing] = {}
        for (job_id, attempt), (status, attempts) in zip(owned.items(), replies, strict=True):
            status_s = text(status) if status is not None else ""
            if status_s == JobStatus.CANCELLED:
                out[job_id] = Standing.CANCELLED
            elif status_s == JobStatus.PROCESSING and attempts is not None \
                    and int(text(attempts)) == attempt:
                out[job_id] = Standing.OK
            else:
                out[job_id] = Standing.LOST
        return out

    async def job(self, job_id: str) -> Job | None:
        raw = decode_hash(await self.redis.hgetall(JOB_KEY.format(job_id=job_id)))
        return Job.from_hash(raw) if raw else None

    async def _run(self, script: str, d: Delivery, *extra: object) -> Any:
        keys = [JOB_KEY.format(job_id=d.job_id), RESULT_KEY.format(job_id=d.job_id),
                JOB_STREAM, DEAD_LETTER_STREAM, WEBHOOK_DUE_KEY,
                WEBHOOK_KEY.format(job_id=d.job_id)]
        args = [JOB_GROUP, d.entry_id, d.job_id, repr(time.time()),
                str(ttl_ms(self.settings.job_ttl_s)), *[str(x) for x in extra]]
        return await self._scripts[script](keys=keys, args=args)
