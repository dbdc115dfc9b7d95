"""A whole lanegate stack for end-to-end tests of the upload APIs.

A real redis-server, then the gateway, one realtime and one batch worker started
by the supervisor's own ``Child``/``Supervisor`` (what ``lanegate up`` runs),
each logging to a file in the work dir. A test module starts one
(module-scoped fixture) with the settings it needs.
"""

from __future__ import annotations

import json
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
from typing import Any

import redis
from conftest import RedisServer

from lanegate.constants import WORKER_KEY, WORKERS_KEY
from lanegate.redis_io import text
from lanegate.supervisor import Child, Supervisor, free_port, http_ready, lanegate_argv

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 15.0
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Stack:
    workdir: Path
    redis: RedisServer
    env: dict[str, str]
    port: int
    procs: dict[str, Child] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.supervisor = Supervisor([], ready=lambda: True, start_timeout_s=START_TIMEOUT_S,
                                     stop_timeout_s=STOP_TIMEOUT_S)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def blob_dir(self) -> Path:
        return self.workdir / "data" / "blobs"

    def child(self, name: str, *args: str) -> Child:
        """A ``lanegate`` child of this stack (a worker stops before the gateway)."""
        child = Child(name, lanegate_argv(*args), self.env, log=self.workdir / f"{name}.log",
                      cwd=str(REPO), stop_order=1 if args[0] == "gateway" else 0)
        old = self.procs.get(name)
        self.supervisor.children = [c for c in self.supervisor.children if c is not old]
        self.supervisor.children.append(child)
        self.procs[name] = child
        return child

    def spawn(self, name: str, *args: str) -> Child:
        child = self.child(name, *args)
        child.start()
        return child

    def diagnostics(self) -> str:
        return self.supervisor.log_tails()

    def check_alive(self) -> None:
        for child in self.procs.values():
            if not child.running:
                raise RuntimeError(f"{child.name} exited\n{self.diagnostics()}")

    @contextmanager
    def paused(self, name: str) -> Iterator[None]:
        """SIGSTOP a process for the block (e.g. the batch worker: jobs stay queued)."""
        child = self.procs[name]
        child.signal(signal.SIGSTOP)
        try:
            yield
        finally:
            child.signal(signal.SIGCONT)

    # --- realtime workers -------------------------------------------------------------
    def live_workers(self) -> dict[str, dict[str, Any]]:
        """worker id -> registry record of each live, non-draining realtime worker that
        answers ``/readyz``, with ``slots_free`` as it says now."""
        client = redis.Redis(port=self.redis.port)
        try:
            out = {}
            for raw in client.smembers(WORKERS_KEY.format(lane="realtime")):
                record = client.get(WORKER_KEY.format(worker_id=text(raw)))
                if record is None:
                    continue
                info = json.loads(record)
                ready = get_json(info["url"] + "/readyz")
                if not info["draining"] and isinstance(ready, dict) and "slots_free" in ready:
                    out[info["worker_id"]] = {**info, "slots_free": ready["slots_free"]}
            return out
        finally:
            client.close()

    def wait_workers(self, n: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self.live_workers()) < n:
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} realtime workers not up\n{self.diagnostics()}")
            time.sleep(0.2)

    def ensure_workers(self, *names: str) -> None:
        """(Re)start the named realtime worker processes that are not running; wait
        until all of them are live."""
        for name in names:
            child = self.procs.get(name)
            if child is None or not child.running:
                self.spawn(name, "worker", "--lane", "realtime")
        self.wait_workers(len(names))

    def busy_workers(self) -> list[str]:
        """Process names of the live realtime workers with a slot in use."""
        pids = {int(worker_id.rsplit("-", 1)[1]) for worker_id, info
                in self.live_workers().items() if info["slots_free"] < info["slots_total"]}
        return [name for name, child in self.procs.items()
                if child.proc is not None and child.proc.pid in pids]

    def stop(self) -> None:
        for child in self.procs.values():
            child.signal(signal.SIGCONT)
        self.supervisor.stop_all()
        self.redis.kill()


def get_json(url: str) -> Any:
    """The JSON body of a GET (error statuses included), or None if nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return json.loads(exc.read())
        except ValueError:
            return None
    except (OSError, ValueError):
        return None


def _batch_worker_alive(client: redis.Redis) -> bool:
    names = [text(i) for i in client.smembers(WORKERS_KEY.format(lane="batch"))]
    return any(client.exists(WORKER_KEY.format(worker_id=name)) for name in names)


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
        "LANEGATE_WYOMING_PORT": "0",  # a test that wants Wyoming names a free port
        **(settings or {}),
    }
    stack = Stack(workdir=workdir, redis=server, env=env, port=port)
    stack.child("gateway", "gateway")
    stack.child("realtime", "worker", "--lane", "realtime")
    if batch:
        stack.child("batch", "worker", "--lane", "batch")
    readyz = http_ready(stack.url + "/readyz")
    client = redis.Redis(port=server.port)
    stack.supervisor.ready = lambda: readyz() and (not batch or _batch_worker_alive(client))
    try:
        stack.supervisor.start_all()
    except BaseException:
        stack.stop()
        raise
    finally:
        client.close()
    return stack


@contextmanager
def lone_gateway(workdir: Path, redis_url: str, **env: str) -> Iterator[str]:
    """A real gateway process with Redis and no worker (its URL); ``env`` adds
    ``LANEGATE_*`` settings. Its log is ``workdir/gateway.log``."""
    port = free_port()
    full_env = {**os.environ, "LANEGATE_REDIS_URL": redis_url, "LANEGATE_PORT": str(port),
                "LANEGATE_WYOMING_PORT": "0", **env}
    log_path = workdir / "gateway.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lanegate.cli", "gateway"],
                                env=full_env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=1):
                    break
            except OSError:
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
