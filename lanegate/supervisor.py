"""``lanegate up``: the embedded deployment in one command.
(Over 400 lines: starting, watching and stopping the children in order is one job.)

Starts, in order: a ``redis-server`` child (unless ``redis_url`` is set) on a
free loopback port with AOF on (``appendfsync`` from ``redis_appendfsync``), its
data and log under ``DATA_DIR/redis``; the
gateway; ``realtime_workers`` realtime workers (default 1) and one batch
worker (when ``lanes = mixed``, one ``mixed`` worker in each of those places
instead, on the same CPUs: the two designs compared on the same hardware).
Each child is ``sys.executable -m lanegate.cli <command>`` with the settings
passed as ``LANEGATE_*`` environment variables, in its own process group (so a terminal's Ctrl-C
reaches only the supervisor, which then stops the children in order).

CPU pinning (``pin_cpus``, on by default, needs two or more usable cores): the
usable CPUs are split in two halves. The realtime workers get the first half
(split between them when it has a core for each) and the batch worker the
second, the software analogue of giving each lane its own GPUs. The gateway and
Redis share the realtime half: they are on the realtime path (every stream
frame crosses the gateway, every session open reads the registry), so a long
batch decode must not delay them either. Mixed workers are pinned exactly as
split's workers are, one per realtime or batch place, each serving streams and
jobs. Children inherit the mask at start.

Readiness: ``up`` waits until the gateway's ``/readyz`` answers 200 (Redis up
and a realtime worker registered) within ``start_timeout_s``, then prints the
URLs. A child that exits during start is fatal: a clear message, every other
child stopped, exit 1. After start a child that exits is restarted with
exponential backoff (1 s doubling to 30 s, jittered; reset after 60 s of good running),
and each restart is logged. SIGINT / SIGTERM stop the workers first (they drain
their sessions and hand their jobs back), then the gateway, then Redis: SIGTERM,
then SIGKILL after ``stop_timeout_s``; exit 0. If the supervisor itself dies
(SIGKILL), a ``DeathWatch`` process (``lanegate/deathwatch.py``) that it started
first sees its pipe close and stops the children in the same order.

``up`` holds a lock on its data directory for the stack's life (one stack per
directory, one line refusing a second) and first stops what a killed stack left
running there (``lanegate/stack_lock.py``). A log reader that goes away or stops
reading stops no process (``lanegate.logs.guard_output``).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from lanegate.deathwatch import DeathWatch, stop_in_order
from lanegate.logs import configure_logging, get_logger
from lanegate.retry import jittered_s
from lanegate.settings import Settings, from_args
from lanegate.stack_lock import DataDirInUse, StackLock
from lanegate.wyoming_access import closed_reason, home_assistant_steps, shown_host

log = get_logger("lanegate.supervisor")

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
#: a child that ran this long before exiting is restarted after BACKOFF_FIRST_S again
STABLE_AFTER_S = 60.0
POLL_S = 0.2
#: the banner's one read of the gateway's /status.json
STATUS_TIMEOUT_S = 5.0


class StartError(RuntimeError):
    """A child could not be started or died during start."""


#: What a child runs before its own program when it must die with its parent or keep
#: to some CPUs: a bare interpreter (``-I``: no site, no environment) that sets both
#: and then execs the program, keeping its pid. Not a ``preexec_fn``: Python code
#: between fork and exec in a process with threads can deadlock (the stdlib says so),
#: and did: the forked copy of a test process that had decoded audio on a thread froze
#: destroying that thread's PyAV state, whose lock an absent thread held.
EXEC_HELPER = """
import ctypes, os, signal, sys
parent, cpus, death = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
if cpus:
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
if death:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        sys.exit(1)  # the parent died before the signal was asked for
os.execvp(sys.argv[4], sys.argv[4:])
"""


def child_argv(argv: list[str], *, cpus: frozenset[int] | None, die_with_parent: bool,
               parent: int) -> list[str]:
    """``argv`` as started: through ``EXEC_HELPER`` when it sets something."""
    if not cpus and not die_with_parent:
        return argv
    listed = ",".join(str(c) for c in sorted(cpus or ()))
    return [sys.executable, "-I", "-c", EXEC_HELPER, str(parent), listed,
            "1" if die_with_parent else "0", *argv]


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cpus: frozenset[int] | None = None
    #: stdout and stderr go here (appended) when set; else they are the supervisor's
    log: Path | None = None
    cwd: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = BACKOFF_FIRST_S
    restart_at: float | None = None
    stop_order: int = 0
    #: when set, ``up`` waits for it before starting the next child
    ready: Callable[[], bool] | None = None
    #: SIGTERM at the parent's death (PR_SET_PDEATHSIG); off under a ``DeathWatch``
    die_with_parent: bool = True

    def start(self) -> None:
        """Start the child in its own process group (``process_group=0``: set by the
        fork itself), dying with this process unless a ``DeathWatch`` stops it
        (``die_with_parent``), on ``cpus`` if given (``child_argv``)."""
        cpus = self.cpus
        program = self.argv[0]
        if "/" not in program and shutil.which(program, path=self.env.get("PATH",
                                                                          os.defpath)) is None:
            # what Popen raises for it: through the helper it would be the child's exit
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
        argv = child_argv(self.argv, cpus=cpus, die_with_parent=self.die_with_parent,
                          parent=os.getpid())
        with contextlib.ExitStack() as files:
            out = files.enter_context(self.log.open("ab")) if self.log else None
            self.proc = subprocess.Popen(argv, env=self.env, cwd=self.cwd, stdout=out,
                                         stderr=subprocess.STDOUT if out else None,
                                         process_group=0)
        self.started_at = time.monotonic()
        self.restart_at = None
        log.info("child_start", child=self.name, pid=self.proc.pid,
                 cpus=sorted(cpus) if cpus else "all", restarts=self.restarts)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 25) -> str:
        """The end of the child's log file ("" without one)."""
        if self.log is None or not self.log.exists():
            return ""
        text = "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return f"--- {self.name} (exit {self.exit_code()}, {self.log}) ---\n{text}"

    def signal(self, sig: int) -> None:
        if self.running:
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)


@dataclass
class Supervisor:
    """Starts children in order, waits for readiness, restarts crashes, stops on signal."""

    children: list[Child]
    ready: Callable[[], bool]
    start_timeout_s: float = 90.0
    stop_timeout_s: float = 15.0
    on_ready: Callable[[], None] = lambda: None
    stopping: bool = field(default=False, init=False)
    #: ``lanegate up``'s lock on its data directory: the death watch holds it too, and
    #: every child started is recorded in it
    lock: StackLock | None = None
    _watch: DeathWatch | None = field(default=None, init=False)

    def request_stop(self, signum: int, frame: FrameType | None = None) -> None:
        if not self.stopping:
            log.info("stop_requested", signal=signal.Signals(signum).name)
        self.stopping = True

    def run(self) -> int:
        """Start, wait until ready, supervise until stopped; the exit code."""
        old = {s: signal.signal(s, self.request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        # If this process dies (SIGKILL, OOM), the watch stops the children in order.
        self._watch = DeathWatch(self.stop_timeout_s,
                                 keep_fds=() if self.lock is None else (self.lock.fd,))
        for child in self.children:
            child.die_with_parent = False
        try:
            try:
                self.start_all()
            except StartError as exc:
                print(f"lanegate up: {exc}", file=sys.stderr)
                log.error("start_failed", error=str(exc))
                self.stop_all()
                return 1
            if self.stopping:
                self.stop_all()
                return 0
            self.on_ready()
            self.supervise()
            self.stop_all()
            return 0
        finally:
            self._watch.close(stopped=not any(c.running for c in self.children))
            self._watch = None
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _started(self, child: Child) -> None:
        if self._watch is not None and child.proc is not None:
            self._watch.announce(child.name, child.stop_order, child.proc.pid)
        if self.lock is not None and child.proc is not None:
            self.lock.record(child.name, child.stop_order, child.proc.pid)

    def start_all(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        for child in self.children:
            try:
                child.start()
            except OSError as exc:
                raise StartError(f"cannot start {child.name}: {exc}") from exc
            self._started(child)
            if child.ready is not None:
                self._wait(child.ready, deadline, child.name)
        self._wait(self.ready, deadline, "the service")

    def _wait(self, probe: Callable[[], bool], deadline: float, what: str) -> None:
        while not self.stopping:
            self._check_start()
            if probe():
                self._check_start()
                return
            if time.monotonic() > deadline:
                raise StartError(f"{what} not ready after {self.start_timeout_s:g} s "
                                 "(start_timeout_s); see the children's logs above"
                                 + self.log_tails())
            time.sleep(POLL_S)

    def _check_start(self) -> None:
        for child in self.children:
            if child.proc is None:
                continue
            code = child.exit_code()
            if code is not None:
                raise StartError(f"{child.name} exited with code {code} during start; "
                                 "see its log above" + self.log_tails())

    def log_tails(self) -> str:
        """The log tails of the children that log to files (a newline first), or ""."""
        tails = [t for t in (c.tail() for c in self.children) if t]
        return "".join("\n" + t for t in tails)

    def supervise(self) -> None:
        while not self.stopping:
            now = time.monotonic()
            for child in self.children:
                self._tend(child, now)
            time.sleep(POLL_S)

    def _tend(self, child: Child, now: float) -> None:
        if child.restart_at is not None:
            if now >= child.restart_at:
                child.restarts += 1
                try:
                    child.start()
                except OSError as exc:
                    log.error("child_restart_failed", child=child.name, error=str(exc))
                    self._schedule_restart(child, now)
                else:
                    self._started(child)
            return
        code = child.exit_code()
        if code is None:
            return
        if now - child.started_at >= STABLE_AFTER_S:
            child.backoff_s = BACKOFF_FIRST_S
        log.warning("child_exited", child=child.name, code=code,
                    ran_s=round(now - child.started_at, 1), restart_in_s=child.backoff_s)
        self._schedule_restart(child, now)

    @staticmethod
    def _schedule_restart(child: Child, now: float) -> None:
        # jittered (lanegate.retry): children that died together do not restart together
        child.restart_at = now + jittered_s(child.backoff_s, child.backoff_s, 0)
        child.backoff_s = min(BACKOFF_MAX_S, child.backoff_s * 2)

    def stop_all(self) -> None:
        """SIGTERM by stop order (workers, gateway, redis), SIGKILL after the timeout."""
        for order in sorted({c.stop_order for c in self.children}):
            group = [c for c in self.children if c.stop_order == order and c.running]
            for child in group:
                child.signal(signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s
            for child in group:
                assert child.proc is not None
                try:
                    child.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("child_killed", child=child.name,
                                after_s=self.stop_timeout_s)
                    child.signal(signal.SIGKILL)
                    child.proc.wait()
                log.info("child_stopped", child=child.name, code=child.proc.returncode)


# --- building the embedded deployment ---------------------------------------------


def cpu_split(settings: Settings) -> tuple[frozenset[int] | None, frozenset[int] | None]:
    """(realtime CPUs, batch CPUs), or (None, None) when not pinning."""
    cpus = sorted(os.sched_getaffinity(0))
    if not settings.pin_cpus or len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return frozenset(cpus[:half]), frozenset(cpus[half:])


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def lanegate_argv(*args: str) -> list[str]:
    """The command line of a ``lanegate`` child: this interpreter, the CLI, ``args``."""
    return [sys.executable, "-m", "lanegate.cli", *args]


def redis_child(settings: Settings, port: int, cpus: frozenset[int] | None) -> Child:
    data = os.path.join(settings.data_path, "redis")
    os.makedirs(data, exist_ok=True)
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", data,
            "--appendonly", "yes", "--appendfsync", settings.redis_appendfsync, "--save", "",
            "--protected-mode", "no", "--loglevel", "warning",
            "--logfile", os.path.join(data, "redis.log")]
    return Child("redis", argv, dict(os.environ), cpus=cpus, stop_order=2,
                 ready=redis_ready(settings.redis_url))


def build_children(settings: Settings) -> tuple[list[Child], Settings]:
    """The children of ``lanegate up`` and the settings they run with."""
    rt_cpus, batch_cpus = cpu_split(settings)
    children: list[Child] = []
    if not settings.internal_token:  # the gateway and workers of this `up` share it
        settings = settings.replace(internal_token=secrets.token_urlsafe(32))
    if not settings.redis_url:
        port = free_port()
        settings = settings.replace(redis_url=f"redis://127.0.0.1:{port}/0")
        children.append(redis_child(settings, port, rt_cpus))
    env = {**os.environ, **settings.to_env()}
    children.append(Child("gateway", lanegate_argv("gateway"), env, cpus=rt_cpus, stop_order=1))
    if settings.lanes == "mixed":
        children.extend(mixed_children(settings, env, rt_cpus, batch_cpus))
    else:
        children.extend(realtime_children(settings, env, rt_cpus))
        children.append(Child("worker-batch", lanegate_argv("worker", "--lane", "batch"),
                              env, cpus=batch_cpus))
    return children, settings


def realtime_children(settings: Settings, env: dict[str, str],
                      cpus: frozenset[int] | None) -> list[Child]:
    """``realtime_workers`` realtime workers; several get their own id, port and (when
    the realtime half has a core for each) CPUs."""
    n = settings.realtime_workers
    argv = lanegate_argv("worker", "--lane", "realtime")
    if n == 1:
        return [Child("worker-realtime", argv, env, cpus=cpus)]
    shares = _split(sorted(cpus), n) if cpus and len(cpus) >= n else [cpus] * n
    children = []
    for i, share in enumerate(shares):
        own = numbered(settings, env, i)
        children.append(Child(f"worker-realtime-{i}", argv, own, cpus=share))
    return children


def numbered(settings: Settings, env: dict[str, str], i: int) -> dict[str, str]:
    """``env`` for the ``i``-th of several workers: its own id and port, where set."""
    own = dict(env)
    if settings.worker_id:
        own["LANEGATE_WORKER_ID"] = f"{settings.worker_id}-{i}"
    if settings.worker_port:
        own["LANEGATE_WORKER_PORT"] = str(settings.worker_port + i)
    return own


def mixed_children(settings: Settings, env: dict[str, str], rt_cpus: frozenset[int] | None,
                   batch_cpus: frozenset[int] | None) -> list[Child]:
    """One mixed worker in each place split puts a worker (each realtime worker's CPUs,
    then the batch worker's), each with its own id and port: the same hardware used
    the other way."""
    places = [c.cpus for c in realtime_children(settings, env, rt_cpus)] + [batch_cpus]
    argv = lanegate_argv("worker", "--lane", "mixed")
    children = []
    for i, cpus in enumerate(places):
        own = numbered(settings, env, i)
        children.append(Child(f"worker-mixed-{i}", argv, own, cpus=cpus))
    return children


def _split(cpus: list[int], n: int) -> list[frozenset[int] | None]:
    """``cpus`` in ``n`` contiguous, nearly equal parts."""
    size, extra = divmod(len(cpus), n)
    parts: list[frozenset[int] | None] = []
    start = 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        parts.append(frozenset(cpus[start:end]))
        start = end
    return parts


def gateway_base(settings: Settings) -> str:
    host = settings.host if settings.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    return f"http://{host}:{settings.port}"


def http_ready(url: str) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    return probe


def redis_ready(url: str) -> Callable[[], bool]:
    """A probe: does the Redis at ``url`` answer PING?"""
    import redis

    def probe() -> bool:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.exceptions.RedisError:
            return False
        finally:
            client.close()

    return probe


def queued_jobs(base: str) -> str:
    """The job backlog as the gateway's ``/status.json`` reports it (from Redis, with
    ``lanes.queue.backlog``), in words for the banner."""
    try:
        with urllib.request.urlopen(base + "/status.json", timeout=STATUS_TIMEOUT_S) as resp:
            queue = json.load(resp).get("queue") or {}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"unknown (cannot read {base}/status.json: {exc})"
    depth = queue.get("depth")
    if depth is None:
        return "unknown (the gateway cannot read Redis)"
    if depth == 0:
        return "none"
    age = float(queue.get("oldest_age_s") or 0.0)
    return (f"{depth} from an earlier run (oldest {age:.0f} s old); they resume first "
            "and new jobs wait behind them")


def banner(settings: Settings, queued: str = "unknown") -> str:
    base = gateway_base(settings)
    ws = base.replace("http://", "ws://", 1)
    return "\n".join([
        "lanegate is up",
        f"  gateway    {base}",
        f"  stream     {ws}/v1/stream?sample_rate=16000",
        f"  uploads    {base}/v1/transcriptions",
        f"  openai     {base}/v1 (POST /v1/audio/transcriptions, /v1/audio/translations)",
        f"  wyoming    {wyoming_line(settings)}",
        f"  status     {base}/status",
        f"  metrics    {base}/metrics",
        f"  redis      {settings.redis_url}",
        f"  lanes      {settings.lanes}, engine {settings.engine}",
        f"  data dir   {settings.data_path}",
        f"  queued     {queued}",
        "Ctrl-C stops everything.",
    ])


def wyoming_line(settings: Settings) -> str:
    """Where Wyoming is served and how Home Assistant adds it, or why it is off."""
    closed = closed_reason(settings)
    if closed is not None:
        return closed
    return (f"tcp://{shown_host(settings.host)}:{settings.wyoming_port}  "
            f"({home_assistant_steps(settings)})")


def stopped_line(children: list[Child]) -> str:
    """One human line after Ctrl-C: what stopped, and any child that did not stop cleanly."""
    names = ", ".join(c.name for c in children if c.proc is not None)
    odd = [f"{c.name} {_how(c.proc.returncode)}" for c in children
           if c.proc is not None and c.proc.returncode not in (0, -signal.SIGTERM)]
    if odd:
        return f"lanegate stopped ({names}); not cleanly: {', '.join(odd)}."
    return f"lanegate stopped: {names} exited cleanly."


def _how(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _print_flushed(text: str) -> None:
    print(text, flush=True)


def run_up(settings: Settings, out: Callable[[str], None] = _print_flushed) -> int:
    """The data directory's lock first (``lanegate/stack_lock.py``), then the stack."""
    try:
        lock = StackLock.take(settings.data_path, gateway_base(settings))
    except DataDirInUse as exc:
        print(f"lanegate up: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"lanegate up: cannot lock the data directory {settings.data_path}: {exc}",
              file=sys.stderr)
        return 1
    try:
        return _run_locked(settings, lock, out)
    finally:
        lock.release()


def stop_leftovers(lock: StackLock, timeout_s: float) -> None:
    """Stop what a killed stack left running in the data directory, in its stop order."""
    left = lock.leftovers()
    if left:
        log.warning("leftovers_stopping", children=sorted(c.name for c in left),
                    message="a lanegate up on this data directory was killed with its death "
                    "watch; stopping what it left running first")
        stop_in_order(left, timeout_s)


def _run_locked(settings: Settings, lock: StackLock, out: Callable[[str], None]) -> int:
    stop_leftovers(lock, settings.stop_timeout_s)  # its gateway may hold the port
    if port_in_use(settings.host, settings.port):
        print(f"lanegate up: port {settings.port} on {settings.host} is already in use; "
              "choose another with --port", file=sys.stderr)
        return 1
    if closed_reason(settings) is None and port_in_use(settings.host, settings.wyoming_port):
        # often another Wyoming server (wyoming-faster-whisper): HTTP comes up anyway
        print(f"lanegate up: port {settings.wyoming_port} on {settings.host} is already in "
              "use, so Wyoming is off; choose another with --wyoming-port", file=sys.stderr)
        settings = settings.replace(wyoming_port=0)
    log.info("up", lanes=settings.lanes, port=settings.port, data_dir=settings.data_path,
             embedded_redis=not settings.redis_url)
    children, settings = build_children(settings)
    base = gateway_base(settings)
    supervisor = Supervisor(
        children, ready=http_ready(base + "/readyz"),
        start_timeout_s=settings.start_timeout_s, stop_timeout_s=settings.stop_timeout_s,
        on_ready=lambda: out(banner(settings, queued_jobs(base))), lock=lock,
    )
    code = supervisor.run()
    if code == 0:
        out(stopped_line(children))
    return code


def main(args: argparse.Namespace) -> int:
    """``lanegate up``."""
    settings = from_args(args)
    configure_logging(settings.log_level, settings.log_format, process="supervisor")
    return run_up(settings)
