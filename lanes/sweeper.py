"""Sweeping orphaned audio blobs: a blob whose job is not queued or processing (a
gateway that died between writing it and submitting, a job skipped or lost, a
submit undone by an OS crash) and that nothing wrote to for
``blob_sweep_min_age_s`` is deleted. Batch workers run it every
``blob_sweep_interval_s``; a Redis lock lets one worker sweep per interval.

A live job's blob is never deleted: the job's status is read after the age check,
and a blob is written before its job is submitted, so a blob whose job is still
to be submitted is young (the minimum age is kept above the longest upload).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

from lanegate.blobs import BlobError, BlobStore
from lanegate.constants import BLOB_SWEEP_LOCK_KEY, JOB_KEY
from lanegate.logs import get_logger
from lanegate.redis_io import text, ttl_ms
from lanegate.settings import Settings
from lanes.job_protocol import JobStatus

log = get_logger("lanes.sweeper")

#: job statuses whose blob is still needed
LIVE = frozenset({JobStatus.QUEUED, JobStatus.PROCESSING})
#: ids checked in Redis per round trip
CHECK_BATCH = 200


class BlobSweeper:
    def __init__(self, redis: Any, settings: Settings, *, worker: str = "") -> None:
        self.redis = redis
        self.settings = settings
        self.blobs = BlobStore(settings.blob_path)
        self._token = f"{worker}:{uuid.uuid4().hex}"

    async def run(self, stop: asyncio.Event) -> None:
        """Sweep every interval until ``stop``; Redis errors wait for the next round."""
        interval = self.settings.blob_sweep_interval_s
        if interval <= 0:
            return
        while not stop.is_set():
            try:
                if await self._take_turn(interval):
                    await self.sweep()
            except Exception as exc:  # Redis down, a disk error: try again next interval
                log.warning("blob_sweep_failed", error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def _take_turn(self, interval: float) -> bool:
        return bool(await self.redis.set(BLOB_SWEEP_LOCK_KEY, self._token, nx=True,
                                         px=ttl_ms(interval * 0.9)))

    async def sweep(self) -> list[str]:
        """One sweep; the ids deleted."""
        old = await asyncio.to_thread(
            lambda: list(self.blobs.older_than(self.settings.blob_sweep_min_age_s)))
        deleted: list[str] = []
        for start in range(0, len(old), CHECK_BATCH):
            ids = old[start:start + CHECK_BATCH]
            async with self.redis.pipeline(transaction=False) as pipe:
                for blob_id in ids:
                    pipe.hget(JOB_KEY.format(job_id=blob_id), "status")
                statuses = await pipe.execute()
            orphans = [b for b, status in zip(ids, statuses, strict=True)
                       if status is None or text(status) not in LIVE]
            await asyncio.to_thread(self._delete, orphans)
            deleted += orphans
        if deleted:
            log.info("blobs_swept", count=len(deleted), checked=len(old))
        return deleted

    def _delete(self, ids: list[str]) -> None:
        for blob_id in ids:
            try:
                self.blobs.delete(blob_id)
            except BlobError:
                continue
