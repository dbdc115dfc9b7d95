"""The worker registry in Redis: heartbeats in, the gateway's view of live workers out.

Each worker writes a JSON record with a TTL (``WORKER_KEY``) and adds its id to
its lane's set (``WORKERS_KEY``). A worker that dies stops refreshing its
record, which expires; readers drop ids whose record is gone.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from lanegate.constants import WORKER_KEY, WORKERS_KEY
from lanegate.redis_io import text, ttl_ms


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    lane: str  # "realtime", "batch" or "mixed"
    url: str  # base URL of the worker's internal HTTP/WebSocket server ("" for batch)
    engine: str
    slots_total: int
    slots_free: int
    step_p99_ms: float
    draining: bool = False
    updated: float = 0.0

    @property
    def load(self) -> float:
        """Fraction of slots in use; the gateway picks the least loaded worker."""
        if self.slots_total <= 0:
            return 1.0
        return 1.0 - self.slots_free / self.slots_total

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerInfo:
        return cls(**json.loads(raw))


def registry_lane(lane: str) -> str:
    """Mixed workers serve streams, so they are listed with the realtime workers."""
    return "realtime" if lane == "mixed" else lane


async def publish(redis: aioredis.Redis, info: WorkerInfo, ttl_s: float) -> None:
    info = WorkerInfo(**{**asdict(info), "updated": time.time()})
    async with redis.pipeline(transaction=True) as pipe:
        pipe.set(WORKER_KEY.format(worker_id=info.worker_id), info.to_json(),
                 px=ttl_ms(ttl_s))
        pipe.sadd(WORKERS_KEY.format(lane=registry_lane(info.lane)), info.worker_id)
        await pipe.execute()


async def remove(redis: aioredis.Redis, worker_id: str, lane: str) -> None:
    async with redis.pipeline(transaction=True) as pipe:
        pipe.delete(WORKER_KEY.format(worker_id=worker_id))
        pipe.srem(WORKERS_KEY.format(lane=registry_lane(lane)), worker_id)
        await pipe.execute()


async def list_workers(redis: aioredis.Redis, lane: str) -> list[WorkerInfo]:
    """Live workers of a lane ("realtime" includes mixed workers)."""
    set_key = WORKERS_KEY.format(lane=registry_lane(lane))
    ids = sorted(text(m) for m in await redis.smembers(set_key))
    if not ids:
        return []
    records = await redis.mget([WORKER_KEY.format(worker_id=i) for i in ids])
    alive: list[WorkerInfo] = []
    gone: list[str] = []
    for worker_id, raw in zip(ids, records, strict=True):
        if raw is None:
            gone.append(worker_id)
        else:
            alive.append(WorkerInfo.from_json(raw))
    if gone:
        await redis.srem(set_key, *gone)
    return alive


def pick_worker(
    workers: list[WorkerInfo], exclude: frozenset[str] = frozenset()
) -> WorkerInfo | None:
    """The live, non-draining worker with a free slot and the least load."""
    candidates = [w for w in workers
                  if w.slots_free > 0 and not w.draining and w.worker_id not in exclude]
    if not candidates:
        return None
    return min(candidates, key=lambda w: (w.load, w.step_p99_ms, w.worker_id))
