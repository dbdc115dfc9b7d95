"""Redis beyond one node: a primary, a replica and a Sentinel (real redis-server processes
on free loopback ports), a batch worker process that reaches Redis through a
``redis+sentinel://`` URL, and a SIGKILL of the primary while jobs run. Sentinel
promotes the replica; the worker follows it by itself and every job completes
exactly once, with its whole transcript."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import free_port, read_pcm, wait_for_redis
from phrases import PARAGRAPH
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from lanegate.blobs import new_id
from lanegate.constants import DEAD_LETTER_STREAM, JOB_GROUP, JOB_STREAM
from lanegate.redis_io import redis_client
from lanegate.settings import Settings
from lanes.jobs import Job, JobStore

REPO = Path(__file__).resolve().parent.parent
SERVICE = "lanegate"
#: Sentinel declares the primary down after this much silence; the failover follows
DOWN_AFTER_MS = 500
#: bounds the whole failover (a stuck one fails the test, not the suite)
FAILOVER_BOUND_S = 20.0
JOBS = 5
#: the simulated engine slowed to about 0.1 s per audio second, in 5 s batches: the
#: jobs are still running when the primary dies
SLOW_SIM = {"engine": "simulated", "sim_prefill_frame_ms": 1.0, "max_window_s": 5.0,
            "soft_cut_search_s": 2.0, "batch_max_audio_s": 5.0, "batch_window_s": 5.0}


class Node:
    """One redis-server (data node or sentinel) child in its own directory."""

    def __init__(self, workdir: Path, args: list[str]) -> None:
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *argv: str) -> None:
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            ["redis-server", *argv, "--port", str(self.port), "--bind", "127.0.0.1",
             "--protected-mode", "no", "--dir", str(self.workdir), *self.args],
            stdout=log, stderr=log)
        wait_for_redis(self.port)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=0.5, decode_responses=True)


class Topology:
    def __init__(self, root: Path) -> None:
        data = ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        self.primary = Node(root / "primary", data)
        self.replica = Node(root / "replica", data)
        self.sentinel = Node(root / "sentinel", [])

    def start(self) -> None:
        self.primary.start()
        self.replica.start("--replicaof", "127.0.0.1", str(self.primary.port))
        conf = self.sentinel.workdir / "sentinel.conf"  # Sentinel rewrites it: its own copy
        conf.write_text("\n".join([
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 1",
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {SERVICE} 5000",
            f"sentinel parallel-syncs {SERVICE} 1", ""]))
        self.sentinel.start(str(conf), "--sentinel")
        self._until(lambda: self._replica_known(), "Sentinel never saw the replica")

    def _replica_known(self) -> bool:
        with self.sentinel.client() as client:
            replicas = client.execute_command("SENTINEL", "REPLICAS", SERVICE)
        return any(_fields(r).get("port") == str(self.replica.port)
                   and "s_down" not in _fields(r).get("flags", "")
                   and _fields(r).get("master-link-status") == "ok" for r in replicas)

    def primary_port(self) -> int:
        with self.sentinel.client() as client:
            _, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(port)

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{SERVICE}/0"

    @staticmethod
    def _until(predicate: Any, message: str, timeout_s: float = FAILOVER_BOUND_S) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            try:
                if predicate():
                    return time.monotonic() - started
            except redis.exceptions.RedisError:
                pass
            time.sleep(0.05)
        raise AssertionError(message)

    def stop(self) -> None:
        for node in (self.sentinel, self.replica, self.primary):
            node.kill()


def _fields(flat: Any) -> dict[str, str]:
    if isinstance(flat, dict):
        return {str(k): str(v) for k, v in flat.items()}
    return {str(flat[i]): str(flat[i + 1]) for i in range(0, len(flat), 2)}


@pytest.fixture
def topology(tmp_path: Path) -> Iterator[Topology]:
    topo = Topology(tmp_path / "redis")
    try:
        topo.start()
        yield topo
    finally:
        topo.stop()


@pytest.fixture
async def store(topology: Topology, tmp_path: Path) -> AsyncIterator[JobStore]:
    settings = Settings(redis_url=topology.url, blob_dir=str(tmp_path / "blobs"))
    client = redis_client(settings.redis_url)
    yield JobStore(client, settings)
    await client.aclose()


@pytest.fixture
def worker_log(topology: Topology, tmp_path: Path) -> Iterator[Path]:
    """A ``lanegate worker --lane batch`` process on the Sentinel URL; its JSON log."""
    settings = Settings(redis_url=topology.url, blob_dir=str(tmp_path / "blobs"),
                        worker_id="b0", worker_port=free_port(), heartbeat_s=0.2,
                        claim_idle_s=2.0, **SLOW_SIM)
    log_path = tmp_path / "worker.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lanegate.cli", "worker", "--lane", "batch"], cwd=REPO,
            env={**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1"},
            stdout=log, stderr=log)
    try:
        yield log_path
        assert proc.poll() is None, "the worker died instead of following the new primary"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


def events(log_path: Path, name: str) -> list[dict[str, Any]]:
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == name:
            out.append(event)
    return out


async def until_logged(log_path: Path, name: str, count: int,
                       timeout_s: float = 10.0) -> list[str]:
    """The job ids of the first ``count`` ``name`` events (all of them, at the bound)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ids = [e["job_id"] for e in events(log_path, name)]
        if len(ids) >= count or time.monotonic() > deadline:
            return ids
        await asyncio.sleep(0.05)


async def jobs_now(store: JobStore, ids: list[str]) -> list[Job]:
    out = []
    for job_id in ids:
        job = await store.get(job_id, "t1")
        assert job is not None, f"job {job_id} is gone"
        out.append(job)
    return out


async def until_jobs(store: JobStore, ids: list[str], predicate: Any,
                     timeout_s: float = 120.0) -> list[Job]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            jobs = await jobs_now(store, ids)
            if predicate(jobs):
                return jobs
        except (RedisConnectionError, RedisTimeoutError):
            pass  # no primary for a moment
        if time.monotonic() > deadline:
            raise AssertionError("the jobs never got there")
        await asyncio.sleep(0.05)


async def test_primary_failover_keeps_every_job_exactly_once(
    topology: Topology, store: JobStore, worker_log: Path, speech: Any,
) -> None:
    pcm, rate = read_pcm(speech(PARAGRAPH))
    assert rate == 16000
    audio_s = len(pcm) / 32000
    ids = []
    for _ in range(JOBS):
        job_id = new_id()
        store.blobs.path(job_id).write_bytes(pcm)
        job, _ = await store.submit(job_id=job_id, tenant="t1", audio_seconds=audio_s)
        ids.append(job.id)

    # some jobs done, the others queued or mid-way
    await until_jobs(store, ids, lambda js: any(j.status == "completed" for j in js))
    before = await jobs_now(store, ids)
    assert any(not j.terminal for j in before), "the jobs finished before the failover"
    # Replication is asynchronous: what the primary acknowledged in its last instant
    # may be lost with it. Everything up to here is on the replica.
    with topology.primary.client() as primary:
        assert primary.execute_command("WAIT", 1, 2000) == 1
    old_port = topology.primary.port
    topology.primary.kill()

    took = Topology._until(lambda: topology.primary_port() == topology.replica.port,
                           "Sentinel never promoted the replica")
    assert topology.primary_port() != old_port
    with topology.replica.client() as promoted:
        assert promoted.info("replication")["role"] == "master"

    done = await until_jobs(store, ids, lambda js: all(j.terminal for j in js))
    assert [j.status for j in done] == ["completed"] * JOBS, [j.error for j in done]
    # the worker logs a completion just after Redis stored it: the last line may lag
    completions = await until_logged(worker_log, "job_completed", JOBS)
    assert sorted(completions) == sorted(ids), "each job completed exactly once"
    assert not events(worker_log, "job_lost")
    for job_id in ids:
        result = await store.result(job_id, "t1")
        assert result is not None
        assert result.text
        assert result.segments[-1].end == pytest.approx(audio_s, abs=0.05)
    client = store.redis
    assert await client.xlen(JOB_STREAM) == 0
    assert (await client.xpending(JOB_STREAM, JOB_GROUP))["pending"] == 0
    assert await client.xlen(DEAD_LETTER_STREAM) == 0
    print(f"failover: replica promoted {took:.2f} s after the primary's SIGKILL")
