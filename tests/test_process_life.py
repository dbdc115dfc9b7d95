"""``lanegate up``'s process life as an operator meets it: a log reader that goes away
(``lanegate up 2>&1 | head -c 300``) or stops reading, a second stack on a data
directory in use, and a stack whose supervisor was killed. Real processes throughout:
``lanegate up`` itself, redis-server, the gateway and the workers (simulated engine)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from conftest import RedisServer, free_port
from phrases import RAIN
from stack import REPO

from lanegate.logs import OUTLET_LINES

PY = sys.executable
BANNER_END = "Ctrl-C stops everything."
#: longer than any wait below: a child that stopped within a wait stopped on its own,
#: not by the supervisor's SIGKILL after stop_timeout_s
STOP_TIMEOUT_S = "300"
#: how long a stop may take here (a busy shared machine), far under STOP_TIMEOUT_S
STOP_WAIT_S = 120
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, Linux (the fcntl module has it from 3.10 on Linux)


class Stack:
    """One ``lanegate up`` on a free port; stdout and stderr where the test says."""

    def __init__(self, data: Path, stdout: Any, stderr: Any, **env_extra: str) -> None:
        self.data = data
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("LANEGATE_")}
        env.pop("PYTHONUNBUFFERED", None)
        env.update(LANEGATE_ENGINE="simulated", LANEGATE_SLOTS="2",
                   LANEGATE_STOP_TIMEOUT_S=STOP_TIMEOUT_S, **env_extra)
        self.proc = subprocess.Popen(
            [PY, "-m", "lanegate.cli", "up", "--port", str(self.port), "--data-dir", str(data)],
            stdout=stdout, stderr=stderr, env=env, cwd=REPO)
        self.pids: set[int] = set()  # every child seen, for the clean-up

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def children(self) -> dict[str, int]:
        """role -> pid of up's children (redis, gateway, realtime, batch, deathwatch)."""
        out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(self.proc.pid)],
                             capture_output=True, text=True, check=False).stdout
        roles = {"redis-server": "redis", "cli gateway": "gateway",
                 "--lane realtime": "realtime", "--lane batch": "batch",
                 "lanegate.deathwatch": "deathwatch"}
        found = {}
        for line in out.splitlines():
            pid, _, args = line.strip().partition(" ")
            for key, role in roles.items():
                if key in args:
                    found[role] = int(pid)
        self.pids |= set(found.values())
        return found

    def ready(self) -> bool:
        return serves(self.base + "/readyz")

    def wait_ready(self, timeout_s: float = 120) -> dict[str, int]:
        """Until /readyz answers 200 and all four children run; the children."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"lanegate up exited with {self.proc.poll()}"
            kids = self.children()
            if self.ready() and {"redis", "gateway", "realtime", "batch"} <= set(kids):
                return kids
            assert time.monotonic() < deadline, "lanegate up was not ready in time"
            time.sleep(0.2)


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids: dict[str, int], timeout_s: float = STOP_WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while running := {role: pid for role, pid in pids.items() if alive(pid)}:
        assert time.monotonic() < deadline, f"still running after SIGTERM: {running}"
        time.sleep(0.2)


def redis_servers_in(data: Path) -> list[int]:
    """The redis-servers working in ``data``/redis (redis-server chdirs to its --dir)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if ("redis-server" in (proc / "cmdline").read_text()
                    and os.readlink(proc / "cwd") == str(data / "redis")):
                found.append(int(proc.name))
    return found


@pytest.fixture
def stacks() -> Iterator[Callable[..., Stack]]:
    """Starts stacks; at the end kills whatever of them is still running."""
    started: list[Stack] = []

    def start(data: Path, stdout: Any = subprocess.DEVNULL, stderr: Any = subprocess.DEVNULL,
              **env_extra: str) -> Stack:
        stack = Stack(data, stdout, stderr, **env_extra)
        started.append(stack)
        return stack

    yield start
    for stack in started:
        if stack.proc.poll() is None:
            stack.children()
            stack.proc.kill()
            stack.proc.wait(30)
        for pid in stack.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def stream_ok(stack: Stack, wav: Path) -> None:
    """``lanegate stream`` through the stack: the gateway and a worker log as it runs."""
    done = subprocess.run([PY, "-m", "lanegate.cli", "stream", str(wav), "--speed", "0",
                           "--url", stack.base], capture_output=True, text=True,
                          timeout=120, check=False, cwd=REPO)
    assert done.returncode == 0, done.stderr


class FullPipe:
    """A pipe of one page that nobody reads once the banner is through: every write to
    it blocks, like a terminal paused with Ctrl-S or a log shipper that hangs."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        fcntl.fcntl(self.write_fd, F_SETPIPE_SZ, 4096)
        self.text = ""
        self.banner = threading.Event()
        self._reader = threading.Thread(target=self._read_until_banner, daemon=True)
        self._reader.start()

    def _read_until_banner(self) -> None:
        while BANNER_END not in self.text:
            chunk = os.read(self.read_fd, 4096)
            if not chunk:
                return
            self.text += chunk.decode(errors="replace")
        self.banner.set()

    def fill(self) -> None:
        """Fill it to the brim, through an open file of its own (non-blocking there only:
        the writers' ends stay blocking)."""
        assert self.banner.wait(120), self.text[-3000:]
        fd = os.open(f"/proc/self/fd/{self.write_fd}", os.O_WRONLY | os.O_NONBLOCK)
        try:
            with contextlib.suppress(BlockingIOError):
                while True:
                    os.write(fd, b"x" * 512)
        finally:
            os.close(fd)

    def close(self) -> None:
        for fd in (self.write_fd, self.read_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


@pytest.fixture
def full_pipe() -> Iterator[FullPipe]:
    pipe = FullPipe()
    yield pipe
    pipe.close()


# --- the log reader goes away ------------------------------------------------------


def test_a_closed_log_pipe_does_not_stop_the_service(
        tmp_path: Path, stacks: Callable[..., Stack], speech: Callable[..., Path]) -> None:
    """``lanegate up 2>&1 | head -c 300``: head exits, the service serves on and stops
    cleanly on Ctrl-C."""
    stack = stacks(tmp_path / "data", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out: IO[bytes] | None = stack.proc.stdout
    assert out is not None
    assert len(out.read(300)) == 300
    out.close()  # head -c 300 exits
    kids = stack.wait_ready()
    stream_ok(stack, speech(RAIN))  # the gateway and the worker log into the closed pipe
    assert stack.proc.poll() is None, "lanegate up died with its log reader"
    assert stack.children() == kids, "a child died with its log reader"
    stack.proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert stack.proc.wait(STOP_WAIT_S) == 0
    wait_gone(kids)


def test_a_full_log_pipe_blocks_no_process_from_stopping(
        tmp_path: Path, stacks: Callable[..., Stack], full_pipe: FullPipe) -> None:
    """Every process logs while it stops; with its log output blocked it still stops on
    SIGTERM, by itself (stop_timeout_s is longer than the wait)."""
    stack = stacks(tmp_path / "data", stdout=full_pipe.write_fd, stderr=full_pipe.write_fd)
    full_pipe.fill()
    kids = stack.wait_ready()
    stack.proc.send_signal(signal.SIGTERM)
    try:
        code = stack.proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        code = None
    assert code == 0, "lanegate up did not stop on SIGTERM with its log output blocked"
    wait_gone(kids)


@pytest.mark.parametrize("command", [("worker", "--lane", "realtime"),
                                     ("worker", "--lane", "batch"), ("gateway",)])
def test_a_service_whose_log_reader_is_gone_stops_on_sigterm(
        command: tuple[str, ...], redis_server: RedisServer, tmp_path: Path) -> None:
    """What a killed ``up`` leaves behind with its log pipe closed: each process still
    stops on SIGTERM (a realtime worker's drain died on its first log line)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LANEGATE_")}
    env.update(LANEGATE_ENGINE="simulated", LANEGATE_SLOTS="2",
               LANEGATE_REDIS_URL=redis_server.url, LANEGATE_DATA_DIR=str(tmp_path / "data"))
    proc = subprocess.Popen([PY, "-m", "lanegate.cli", *command, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        assert proc.stdout is not None
        url = f"http://127.0.0.1:{port}"  # the gateway's; a worker logs its own
        for line in proc.stdout:
            event = json.loads(line) if line.startswith(b"{") else {}
            if event.get("event") in ("worker_started", "gateway_start"):
                url = event.get("url", url)
                break
        deadline = time.monotonic() + 60
        while not serves(url + "/healthz"):
            assert proc.poll() is None, proc.poll()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        proc.stdout.close()  # the log reader is gone
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, f"{' '.join(command)} did not stop on SIGTERM (exit {code})"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def serves(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def test_a_reader_that_pauses_gets_the_held_lines_then_the_count_of_the_dropped(
        tmp_path: Path) -> None:
    """A process that logs more than ``OUTLET_LINES`` while its reader is paused does not
    wait for it; when the reader reads again it gets the lines held and one line that
    counts the rest."""
    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, F_SETPIPE_SZ, 4096)
    code = ("import sys, time\n"
            "from lanegate.logs import OUTLET_LINES, configure_logging, get_logger, guard_output\n"
            "guard_output()\nconfigure_logging('info', 'json')\nlog = get_logger('test')\n"
            "for i in range(3 * OUTLET_LINES):\n    log.info('line', i=i)\n"
            "open(sys.argv[1], 'w').close()\ntime.sleep(60)\n")
    logged = tmp_path / "logged"
    proc = subprocess.Popen([PY, "-c", code, str(logged)], stdout=write_fd, stderr=write_fd,
                            cwd=REPO)
    os.close(write_fd)
    try:
        deadline = time.monotonic() + 60
        while not logged.exists():  # every line logged while nobody reads
            assert proc.poll() is None
            assert time.monotonic() < deadline, "the process waited for its reader"
            time.sleep(0.1)
        text = b""
        while b"log_lines_dropped" not in text:
            text += os.read(read_fd, 1 << 16)
            assert time.monotonic() < deadline + 60
        lines = [json.loads(line) for line in text.splitlines()]
        (notice,) = [e for e in lines if e["event"] == "log_lines_dropped"]
        held = [e["i"] for e in lines if e["event"] == "line"]
        assert held == list(range(len(held)))  # the first lines, in order
        assert len(held) + notice["count"] == 3 * OUTLET_LINES
    finally:
        proc.kill()
        proc.wait(30)
        os.close(read_fd)


# --- one data directory, one stack ---------------------------------------------------------


def test_a_second_stack_on_a_data_dir_in_use_is_refused_in_one_line(
        tmp_path: Path, stacks: Callable[..., Stack]) -> None:
    data = tmp_path / "data"
    first = stacks(data)
    first.wait_ready()
    second = stacks(data, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = second.proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"a second stack started on {data}: redis-servers "
                             f"{redis_servers_in(data)}") from None
    assert second.proc.returncode == 1
    lines = err.decode().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("lanegate up: ")
    assert f"data directory {data} is in use" in lines[0]
    assert f"pid {first.proc.pid}" in lines[0]
    assert first.base in lines[0]
    assert out == b""
    assert len(redis_servers_in(data)) == 1
    assert first.ready()


def test_a_crashed_stack_is_stopped_before_the_next_starts(
        tmp_path: Path, stacks: Callable[..., Stack]) -> None:
    """The supervisor and its death watch SIGKILLed, the log reader gone: the next ``up``
    on that data directory stops what was left (each on SIGTERM, by itself) and starts
    its own redis-server: never two on one journal."""
    data = tmp_path / "data"
    crashed = stacks(data, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    old = crashed.wait_ready()
    assert crashed.proc.stdout is not None
    crashed.proc.stdout.close()  # the leftovers' log writes fail
    os.kill(old.pop("deathwatch"), signal.SIGKILL)
    crashed.proc.kill()
    crashed.proc.wait(30)
    time.sleep(1)  # let a dying child die
    left = {role: pid for role, pid in old.items() if alive(pid)}
    assert "redis" in left

    log = tmp_path / "next.err"
    with open(log, "wb") as err:
        after = stacks(data, stderr=err)
    new = after.wait_ready(timeout_s=STOP_WAIT_S)
    gone = [role for role, pid in left.items() if not alive(pid)]
    assert sorted(gone) == sorted(left), f"left running: {left}"
    assert redis_servers_in(data) == [new["redis"]]
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    stopped = sorted(e["child"] for e in events if e["event"] == "orphan_stopped")
    assert stopped == sorted(f"{role}" if role in ("redis", "gateway") else f"worker-{role}"
                             for role in left)
    assert not [e for e in events if e["event"] == "orphan_killed"]
    after.proc.send_signal(signal.SIGTERM)
    assert after.proc.wait(STOP_WAIT_S) == 0
