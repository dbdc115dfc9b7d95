"""A whole lanegate stack for end-to-end tests of the upload APIs.

A real redis-server, then ``python -m lanegate.cli gateway``, one realtime and
one batch worker as subprocesses, each logging to a file in the work dir. A
test module starts one (module-scoped fixture) with the settings it needs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis
from conftest import RedisServer, free_port

from lanegate.constants import WORKER_KEY, WORKERS_KEY

START_TIMEOUT_S = 90.0
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 25) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Stack:
    workdir: Path
    redis: RedisServer
    env: dict[str, str]
    port: int
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def blob_dir(self) -> Path:
        return self.workdir / "data" / "blobs"

    def spawn(self, name: str, *args: str) -> Proc:
        log = self.workdir / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen([sys.executable, "-m", "lanegate.cli", *args],
                                     env=self.env, cwd=REPO, stdout=out,
                                     stderr=subprocess.STDOUT)
        proc = Proc(name, popen, log)
        self.procs[name] = proc
        return proc

    def diagnostics(self) -> str:
        return "\n".join(f"--- {p.name} (exit {p.popen.poll()}) ---\n{p.tail()}"
                         for p in self.procs.values())

    def check_alive(self) -> None:
        for proc in self.procs.values():
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited\n{self.diagnostics()}")

    @contextmanager
    def paused(self, name: str) -> Iterator[None]:
        """SIGSTOP a process for the block (e.g. the batch worker: jobs stay queued)."""
        popen = self.procs[name].popen
        popen.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            popen.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)
                proc.popen.terminate()
        for proc in self.procs.values():
            try:
                proc.popen.wait(15)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)
        self.redis.kill()


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def _batch_worker_alive(client: redis.Redis) -> bool:
    ids = client.smembers(WORKERS_KEY.format(lane="batch"))
    names = [i.decode() if isinstance(i, bytes) else str(i) for i in ids]
    return any(client.exists(WORKER_KEY.format(worker_id=name)) for name in names)


def _wait_ready(stack: Stack, *, batch: bool) -> None:
    client = redis.Redis(port=stack.redis.port)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            stack.check_alive()
            if _get(stack.url + "/readyz") == 200 and (not batch or _batch_worker_alive(client)):
                return
            time.sleep(0.2)
    finally:
        client.close()
    raise RuntimeError(f"stack not ready after {START_TIMEOUT_S} s\n{stack.diagnostics()}")


def start_stack(workdir: Path, *, settings: dict[str, str] | None = None,
                batch: bool = True, realtime_slots: int = 3) -> Stack:
    """Redis, gateway, a realtime worker and (``batch``) a batch worker, all ready.

    Three realtime slots: with one kept for live streams (``upload_reserve_slots``)
    and the registry up to a heartbeat stale, back-to-back short uploads still
    find the realtime lane open."""
    workdir.mkdir(parents=True, exist_ok=True)
    server = RedisServer(workdir / "redis")
    server.start()
    port = free_port()
    env = {
        **os.environ,
        "LANEGATE_REDIS_URL": server.url,
        "LANEGATE_DATA_DIR": str(workdir / "data"),
        "LANEGATE_PORT": str(port),
        "LANEGATE_SLOTS": str(realtime_slots),
        "LANEGATE_LOG_LEVEL": "info",
        "LANEGATE_ENGINE": "pocketsphinx",
        **(settings or {}),
    }
    stack = Stack(workdir=workdir, redis=server, env=env, port=port)
    try:
        stack.spawn("gateway", "gateway")
        stack.spawn("realtime", "worker", "--lane", "realtime")
        if batch:
            stack.spawn("batch", "worker", "--lane", "batch")
        _wait_ready(stack, batch=batch)
    except BaseException:
        stack.stop()
        raise
    return stack
