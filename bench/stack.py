"""Start and stop the service in one design: redis-server, the gateway, the workers.

Each process is a ``lanegate.supervisor.Child`` (what ``lanegate up`` starts)
running the same ``lanegate`` CLI a user runs, configured by ``LANEGATE_*``
environment variables; workers are pinned with ``taskset``. The exact command
lines and environment are kept for the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis

from lanegate.settings import Settings
from lanegate.supervisor import Child, Supervisor, free_port, lanegate_argv
from lanes.registry import WorkerInfo, list_workers

CLK_TCK = os.sysconf("SC_CLK_TCK")
#: how long a child may take to exit on SIGTERM before it is killed
STOP_GRACE_S = 5.0


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
    load_cpus: str = ""  # the load clients' (``bench.measure.run_load``)
    # what the gateway's command runs under (``bench.instructions``: valgrind), and how
    # long it may then take to answer /readyz
    gateway_prefix: tuple[str, ...] = ()
    gateway_ready_s: float = 60.0


def runqueue_wait_seconds(child: Child) -> float:
    """Time the process's threads were runnable but waiting for a CPU (schedstat)."""
    assert child.proc is not None
    total = 0
    for task in Path(f"/proc/{child.proc.pid}/task").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def cpu_seconds(child: Child) -> float:
    """utime + stime of the process from /proc/<pid>/stat."""
    assert child.proc is not None
    fields = Path(f"/proc/{child.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


async def listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port``."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


#: where each stack's logs are kept, beside the stacks' directories
LOGS_DIR = "logs"


class StackError(RuntimeError):
    pass


def cpu_list(cpus: str) -> list[int]:
    """The CPUs of a ``taskset`` list ("0", "0-1", "0,2-3"), sorted."""
    out: set[int] = set()
    for part in cpus.split(","):
        low, _, high = part.strip().partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return sorted(out)


def pin(cpus: str) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


class Stack:
    """A running service. Use ``async with Stack(plan, workdir) as stack``."""

    def __init__(self, plan: StackPlan, workdir: Path) -> None:
        self.plan = plan
        self.workdir = workdir / plan.design
        self.redis_port = free_port()
        self.gateway_port = free_port()
        # Wyoming's TCP listener: a port of this stack's own (its default, 10300, is one
        # per host; ``bench.protocols`` measures the adapter on it)
        self.wyoming_port = free_port()
        self.supervisor = Supervisor([], ready=lambda: True, stop_timeout_s=STOP_GRACE_S)
        self.redis: aioredis.Redis | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def children(self) -> list[Child]:
        return self.supervisor.children

    def pid(self, name: str) -> int:
        """The process id of the child called ``name`` (``gateway``, ``redis``, ...)."""
        for child in self.children:
            if child.name == name and child.proc is not None:
                return child.proc.pid
        raise StackError(f"{self.plan.design}: no running {name}")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each live child, from /proc."""
        return self._per_child(cpu_seconds)

    def runqueue_wait_seconds(self) -> dict[str, float]:
        """Seconds each live child has waited for a CPU so far, from /proc schedstat."""
        return self._per_child(runqueue_wait_seconds)

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
                "LANEGATE_WYOMING_PORT": str(self.wyoming_port),
                **self.plan.env}

    def spawn(self, name: str, argv: list[str], env: dict[str, str], stop_order: int) -> Child:
        """Start a child with ``env`` (its ``LANEGATE_*``) over this environment less
        any ``LANEGATE_*`` of its own."""
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("LANEGATE_")}
        full_env.update(env)
        child = Child(name, argv, full_env, log=self.workdir / f"{name}.log",
                      stop_order=stop_order)
        child.start()
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
        self.keep_logs()

    def keep_logs(self) -> Path:
        """Copy this stack's logs to ``logs/NNN-<design>/`` beside its directory, in the
        order the stacks ran: the next stack of the same design starts afresh, and a
        slow round's gateway and workers can still be read after the run."""
        logs = self.workdir.parent / LOGS_DIR
        logs.mkdir(parents=True, exist_ok=True)
        dest = logs / f"{sum(1 for _ in logs.iterdir()) + 1:03d}-{self.plan.design}"
        dest.mkdir()
        for log in self.workdir.glob("*.log"):
            shutil.copy2(log, dest)
        return dest

    async def start(self) -> None:
        self.spawn("redis", [*pin(self.plan.redis_cpus), "redis-server",
                             "--port", str(self.redis_port), "--bind", "127.0.0.1",
                             "--dir", str(self.workdir / "data"), "--appendonly", "yes",
                             "--save", "", "--protected-mode", "no"], {}, stop_order=2)
        self.redis = aioredis.Redis.from_url(self.redis_url)
        await self.wait_for(self.redis_up, "redis-server", 10)
        for i, w in enumerate(self.plan.workers):
            self.spawn(f"worker-{w.lane}-{i}",
                       [*pin(w.cpus), *lanegate_argv("worker", "--lane", w.lane)],
                       {**self.base_env(), "LANEGATE_WORKER_ID": f"bench-{w.lane}-{i}",
                        **w.env}, stop_order=1)
        self.spawn("gateway", [*pin(self.plan.gateway_cpus), *self.plan.gateway_prefix,
                               *lanegate_argv("gateway")], self.base_env(), stop_order=0)
        await self.wait_for(self.workers_up, "workers in the registry", 120)
        await self.wait_for(self.gateway_ready, "gateway /readyz", self.plan.gateway_ready_s)

    async def start_floor(self, name: str = "floor", *args: str, module: str = "bench.floor",
                          prefix: tuple[str, ...] = (), ready_s: float = 30.0) -> str:
        """A bare server (``bench.floor``, or ``module`` with the same flags) with
        ``args`` beside the stack, on the gateway's CPUs, as child ``name``, its command
        run under ``prefix``; its URL."""
        port = free_port()
        self.spawn(name, [*pin(self.plan.gateway_cpus), *prefix, sys.executable, "-m",
                          module, "--port", str(port), *args], {}, stop_order=0)
        await self.wait_for(lambda: listening(port), module, ready_s)
        return f"http://127.0.0.1:{port}"

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
        dead = [c for c in self.children if not c.running]
        if dead:
            raise StackError(f"{self.plan.design}: {', '.join(c.name for c in dead)} exited\n"
                             + self.log_tails())

    def log_tails(self) -> str:
        return self.supervisor.log_tails()

    async def stop(self) -> None:
        """Gateway first, then the workers together, then redis-server."""
        await asyncio.to_thread(self.supervisor.stop_all)
        if self.redis is not None:
            await self.redis.aclose()
            self.redis = None

    def describe(self) -> dict[str, object]:
        """Exact commands, LANEGATE_* environment and the effective settings (defaults
        included) of every child, for the report."""
        return {"design": self.plan.design, "load_cpus": self.plan.load_cpus,
                "processes": [{"name": c.name, "argv": [os.path.basename(a) if a ==
                                                        sys.executable else a
                                                        for a in c.argv],
                               "env": {k: v for k, v in sorted(c.env.items())
                                       if k.startswith("LANEGATE_")},
                               "settings": (dataclasses.asdict(Settings.from_env(c.env))
                                            if c.name != "redis"
                                            and not c.name.startswith("floor")
                                            else None)}
                              for c in self.children]}
