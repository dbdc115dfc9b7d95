"""Start and stop the service in one design: redis-server, the gateway, the workers.

Each process is a child started with the same ``lanegate`` CLI a user runs,
configured by ``LANEGATE_*`` environment variables; workers are pinned with
``taskset``. The exact command lines and environment are kept for the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis

from lanegate.settings import Settings
from workers.registry import WorkerInfo, list_workers

CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class WorkerPlan:
    lane: str  # realtime | batch | mixed
    cpus: str = ""  # taskset CPU list; "" = not pinned
    env: dict[str, str] = field(default_factory=dict)  # extra env for this worker only


@dataclass
class StackPlan:
    design: str  # split | mixed | split-nocap | sim-... : a name for the report
    env: dict[str, str]  # LANEGATE_* for every process
    workers: list[WorkerPlan]
    gateway_cpus: str = ""  # taskset CPU list for the gateway; "" = not pinned
    redis_cpus: str = ""


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    log: Path

    def runqueue_wait_seconds(self) -> float:
        """Time the process's threads were runnable but waiting for a CPU (schedstat)."""
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                total += int((task / "schedstat").read_text().split()[1])
        return total / 1e9

    def cpu_seconds(self) -> float:
        """utime + stime of the process from /proc/<pid>/stat."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK


class StackError(RuntimeError):
    pass


def pin(cpus: str) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


def wait_exit(proc: subprocess.Popen[bytes], limit_s: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(max(0.0, limit_s))


class Stack:
    """A running service. Use ``async with Stack(plan, workdir) as stack``."""

    def __init__(self, plan: StackPlan, workdir: Path) -> None:
        self.plan = plan
        self.workdir = workdir / plan.design
        self.redis_port = free_port()
        self.gateway_port = free_port()
        self.children: list[Child] = []
        self.redis: aioredis.Redis | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def gateway(self) -> Child:
        return next(c for c in self.children if c.name == "gateway")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each live child, from /proc."""
        return self._per_child(Child.cpu_seconds)

    def runqueue_wait_seconds(self) -> dict[str, float]:
        """Seconds each live child has waited for a CPU so far, from /proc schedstat."""
        return self._per_child(Child.runqueue_wait_seconds)

    def _per_child(self, read: Callable[[Child], float]) -> dict[str, float]:
        """``read`` of each child whose /proc entry still exists."""
        out = {}
        for child in self.children:
            with contextlib.suppress(OSError):
                out[child.name] = read(child)
        return out

    def base_env(self) -> dict[str, str]:
        return {"LANEGATE_REDIS_URL": self.redis_url,
                "LANEGATE_DATA_DIR": str(self.workdir / "data"),
                "LANEGATE_PORT": str(self.gateway_port),
                **self.plan.env}

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> Child:
        log = self.workdir / f"{name}.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("LANEGATE_")}
        full_env.update(env)
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        child = Child(name, argv, env, proc, log)
        self.children.append(child)
        return child

    async def __aenter__(self) -> Stack:
        # A fresh Redis (its AOF) and blob store: no job of an earlier run may come back.
        shutil.rmtree(self.workdir, ignore_errors=True)
        (self.workdir / "data").mkdir(parents=True)
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        self.spawn("redis", [*pin(self.plan.redis_cpus), "redis-server",
                             "--port", str(self.redis_port), "--bind", "127.0.0.1",
                             "--dir", str(self.workdir / "data"), "--appendonly", "yes",
                             "--save", "", "--protected-mode", "no"], {})
        self.redis = aioredis.Redis.from_url(self.redis_url)
        await self.wait_for(self.redis_up, "redis-server", 10)
        lanegate = [sys.executable, "-m", "lanegate.cli"]
        for i, w in enumerate(self.plan.workers):
            self.spawn(f"worker-{w.lane}-{i}",
                       [*pin(w.cpus), *lanegate, "worker", "--lane", w.lane],
                       {**self.base_env(), "LANEGATE_WORKER_ID": f"bench-{w.lane}-{i}",
                        **w.env})
        self.spawn("gateway", [*pin(self.plan.gateway_cpus), *lanegate, "gateway"],
                   self.base_env())
        await self.wait_for(self.workers_up, "workers in the registry", 120)
        await self.wait_for(self.gateway_ready, "gateway /readyz", 60)

    async def redis_up(self) -> bool:
        assert self.redis is not None
        try:
            return bool(await self.redis.ping())
        except (aioredis.ConnectionError, OSError):
            return False

    async def workers_up(self) -> bool:
        want = {w.lane for w in self.plan.workers}
        realtime = await self.realtime_workers()
        batch = await self.batch_workers() if "batch" in want else []
        n_rt = sum(1 for w in self.plan.workers if w.lane != "batch")
        n_b = sum(1 for w in self.plan.workers if w.lane == "batch")
        return len(realtime) >= n_rt and len(batch) >= n_b

    async def gateway_ready(self) -> bool:
        try:
            async with aiohttp.ClientSession() as http, \
                    http.get(self.url + "/readyz", timeout=aiohttp.ClientTimeout(2)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def realtime_workers(self) -> list[WorkerInfo]:
        assert self.redis is not None
        return await list_workers(self.redis, "realtime")

    async def batch_workers(self) -> list[WorkerInfo]:
        assert self.redis is not None
        return await list_workers(self.redis, "batch")

    async def wait_for(self, check: Callable[[], Awaitable[bool]], what: str,
                       limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            self.check_alive()
            if await check():
                return
            await asyncio.sleep(0.2)
        raise StackError(f"{self.plan.design}: {what} not ready after {limit_s:.0f} s\n"
                         + self.log_tails())

    def check_alive(self) -> None:
        dead = [c for c in self.children if c.proc.poll() is not None]
        if dead:
            raise StackError(f"{self.plan.design}: {', '.join(c.name for c in dead)} exited\n"
                             + self.log_tails())

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for c in self.children:
            tail = c.log.read_text(errors="replace").splitlines()[-lines:] if c.log.exists() \
                else []
            out.append(f"--- {c.name} ({c.log}) ---\n" + "\n".join(tail))
        return "\n".join(out)

    async def stop(self) -> None:
        """Gateway first, then the workers together, then redis-server."""
        gateway = [c for c in self.children if c.name == "gateway"]
        workers = [c for c in self.children if c.name.startswith("worker")]
        rest = [c for c in self.children if c not in gateway and c not in workers]
        for group in (gateway, workers, rest):
            await self.stop_group(group)
        if self.redis is not None:
            await self.redis.aclose()
            self.redis = None

    @staticmethod
    async def stop_group(children: list[Child], grace_s: float = 8.0) -> None:
        for child in children:
            if child.proc.poll() is None:
                os.killpg(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in children:
            await asyncio.to_thread(wait_exit, child.proc, deadline - time.monotonic())
            if child.proc.poll() is None:
                os.killpg(child.proc.pid, signal.SIGKILL)
                child.proc.wait(5)

    def describe(self) -> dict[str, object]:
        """Exact commands, LANEGATE_* environment and the effective settings (defaults
        included) of every child, for the report."""
        return {"design": self.plan.design,
                "processes": [{"name": c.name, "argv": [os.path.basename(a) if a ==
                                                        sys.executable else a
                                                        for a in c.argv],
                               "env": dict(sorted(c.env.items())),
                               "settings": (dataclasses.asdict(Settings.from_env(c.env))
                                            if c.name != "redis" else None)}
                              for c in self.children]}
