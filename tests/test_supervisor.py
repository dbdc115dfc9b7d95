"""``lanegate up`` and its Supervisor: real child processes throughout.

The Supervisor's rules are checked with tiny Python children (start failure,
restart with backoff, ordered stop); ``lanegate up`` itself is run as a real
subprocess that starts redis-server, the gateway and the workers, streams real
speech through ``lanegate stream``, and stops on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import wave
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import redis
from conftest import free_port
from phrases import SENTENCE_RECALL, TRAFFIC, recall

from lanegate.settings import Appendfsync, Settings, SettingsError
from lanegate.supervisor import Child, StartError, Supervisor, build_children, cpu_split

PY = sys.executable
ONE = TRAFFIC


def py_child(name: str, code: str, **kwargs: object) -> Child:
    return Child(name, [PY, "-c", code], dict(os.environ), **kwargs)  # type: ignore[arg-type]


def test_a_child_dying_at_start_stops_the_others_and_fails() -> None:
    sleeper = py_child("sleeper", "import time; time.sleep(60)")
    crasher = py_child("crasher", "import sys; sys.exit(3)")
    supervisor = Supervisor([sleeper, crasher], ready=lambda: False, start_timeout_s=30,
                            stop_timeout_s=5)
    assert supervisor.run() == 1
    assert not sleeper.running
    assert crasher.exit_code() == 3


def test_not_ready_in_time_fails() -> None:
    sleeper = py_child("sleeper", "import time; time.sleep(60)")
    supervisor = Supervisor([sleeper], ready=lambda: False, start_timeout_s=0.5,
                            stop_timeout_s=5)
    assert supervisor.run() == 1
    assert not sleeper.running


def test_a_crash_after_start_is_restarted_with_backoff(tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    code = (f"import time; open({str(starts)!r}, 'a').write('x'); time.sleep(0.3); "
            "raise SystemExit(1)")
    flaky = py_child("flaky", code)
    supervisor = Supervisor([flaky], ready=lambda: True, stop_timeout_s=5)

    def stop_after_restarts() -> None:
        while flaky.restarts < 2:
            time.sleep(0.05)
        supervisor.stopping = True

    watcher = threading.Thread(target=stop_after_restarts, daemon=True)
    watcher.start()
    assert supervisor.run() == 0
    watcher.join(30)
    assert starts.read_text() == "x" * (flaky.restarts + 1)
    assert flaky.backoff_s == 4.0  # 1 s, then 2 s, doubling


def test_stop_is_ordered_and_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    log = tmp_path / "order"
    polite = ("import signal, sys, time\n"
              f"def bye(*_): open({str(log)!r}, 'a').write(NAME + ' '); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, bye)\n"
              "time.sleep(60)\n")
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    first = py_child("first", "NAME='first'\n" + polite, stop_order=0)
    second = py_child("second", "NAME='second'\n" + polite, stop_order=1)
    deaf = py_child("deaf", stubborn, stop_order=1)
    supervisor = Supervisor([second, deaf, first], ready=lambda: True, stop_timeout_s=1)
    supervisor.start_all()
    time.sleep(0.5)  # let the children install their handlers
    supervisor.stop_all()
    assert log.read_text().split() == ["first", "second"]
    assert deaf.exit_code() == -signal.SIGKILL


def test_a_child_starts_while_another_thread_holds_what_its_state_needs() -> None:
    """Nothing of this process runs in the child between fork and exec: a forked copy
    that ran Python there destroyed the other threads' state first and froze on a lock
    that a thread, absent in the copy, held (the stdlib's warning on ``preexec_fn``;
    seen with a test process's PyAV state from decoding on a thread)."""
    held = threading.Lock()
    held.acquire()  # locked at the fork, so locked for good in the forked copy

    class NeedsTheLock:
        def __del__(self) -> None:
            with held:
                pass

    local = threading.local()
    go_on = threading.Event()

    def keep() -> None:
        local.value = NeedsTheLock()
        go_on.wait()

    thread = threading.Thread(target=keep)
    thread.start()
    child = py_child("plain", "import time; time.sleep(0.1)", cpus=frozenset({0}))
    try:
        child.start()
        assert child.proc is not None
        assert child.proc.wait(timeout=30) == 0, "the child ran and exited"
    finally:
        if child.proc is not None and child.proc.poll() is None:
            child.proc.kill()
        held.release()
        go_on.set()
        thread.join()


def test_a_child_keeps_its_pid_cpus_and_group_and_dies_with_its_parent(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    parent = subprocess.Popen([PY, "-c", (
        "import os, sys, time\n"
        "from lanegate.supervisor import Child\n"
        "c = Child('sleeper', [sys.executable, '-c', 'import time; time.sleep(60)'],"
        " dict(os.environ), cpus=frozenset({0}))\n"
        "c.start()\n"
        f"open({str(pids)!r}, 'w').write(str(c.proc.pid))\n"
        "time.sleep(60)\n")])
    try:
        deadline = time.monotonic() + 30
        while not pids.exists() or not pids.read_text():
            assert time.monotonic() < deadline
            assert parent.poll() is None
            time.sleep(0.05)
        pid = int(pids.read_text())
        deadline = time.monotonic() + 10
        while b"execvp" in Path(f"/proc/{pid}/cmdline").read_bytes():  # still the helper
            assert time.monotonic() < deadline, "the pid Popen gave runs the program itself"
            time.sleep(0.02)
        status = Path(f"/proc/{pid}/status").read_text()
        assert "Cpus_allowed_list:\t0\n" in status
        assert os.getpgid(pid) == pid, "its own process group"
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "State:\tZ" not in Path(
            f"/proc/{pid}/status").read_text():
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.05)


def test_a_missing_program_is_a_start_error_that_names_it() -> None:
    ghost = Child("ghost", ["lanegate-no-such-program"], dict(os.environ))
    supervisor = Supervisor([ghost], ready=lambda: True)
    with pytest.raises(StartError, match=r"cannot start ghost: .*lanegate-no-such-program"):
        supervisor.start_all()


def test_cpu_split_is_disjoint_and_covers_the_machine() -> None:
    realtime, batch = cpu_split(Settings())
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        assert (realtime, batch) == (None, None)
        return
    assert realtime is not None
    assert batch is not None
    assert realtime.isdisjoint(batch)
    assert realtime | batch == cpus
    assert cpu_split(Settings(pin_cpus=False)) == (None, None)
    assert cpu_split(Settings(lanes="mixed")) == (realtime, batch)  # the same places


def test_children_of_split_and_mixed(tmp_path: Path) -> None:
    children, settings = build_children(Settings(data_dir=str(tmp_path)))
    assert [c.name for c in children] == ["redis", "gateway", "worker-realtime", "worker-batch"]
    assert settings.redis_url.startswith("redis://127.0.0.1:")
    assert children[1].env["LANEGATE_REDIS_URL"] == settings.redis_url
    assert (tmp_path / "redis").is_dir()
    mixed, _ = build_children(Settings(lanes="mixed", redis_url="redis://127.0.0.1:1/0"))
    assert [c.name for c in mixed] == ["gateway", "worker-mixed-0", "worker-mixed-1"]


@pytest.mark.parametrize("mode", list(Appendfsync))
def test_the_redis_child_fsyncs_as_the_setting_says(tmp_path: Path, mode: Appendfsync) -> None:
    children, settings = build_children(Settings(data_dir=str(tmp_path),
                                                 redis_appendfsync=mode.value))
    redis_child = children[0]
    assert redis_child.ready is not None
    redis_child.start()
    try:
        deadline = time.monotonic() + 30
        while not redis_child.ready():
            assert redis_child.running
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client = redis.Redis.from_url(settings.redis_url)
        assert client.config_get("appendfsync") == {"appendfsync": mode.value}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        client.close()
    finally:
        redis_child.signal(signal.SIGTERM)
        assert redis_child.proc is not None
        redis_child.proc.wait(30)


def test_appendfsync_defaults_to_everysec_and_refuses_other_values() -> None:
    assert Settings().redis_appendfsync == Appendfsync.EVERYSEC
    with pytest.raises(SettingsError, match="LANEGATE_REDIS_APPENDFSYNC"):
        Settings(redis_appendfsync="sometimes")


# --- lanegate up, for real -----------------------------------------------------------


class Up:
    def __init__(self, workdir: Path, port: int, *extra: str,
                 env_extra: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.port = port
        self.out = workdir / "up.out"
        self.err = workdir / "up.err"
        env = {**os.environ, "LANEGATE_SLOTS": "2", "LANEGATE_LOG_LEVEL": "info",
               "LANEGATE_ENGINE": "pocketsphinx", **(env_extra or {})}
        env.pop("LANEGATE_REDIS_URL", None)
        env.pop("PYTHONUNBUFFERED", None)  # the banner must be flushed by up itself
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [PY, "-m", "lanegate.cli", "up", "--port", str(port),
                 "--data-dir", str(workdir / "data"), *extra],
                stdout=out, stderr=err, env=env)

    def wait_for(self, text: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.out.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} from lanegate up (exit {self.proc.poll()})"
                                     f"\n{self.err.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)

    def children(self) -> dict[str, int]:
        """command line -> pid of up's children."""
        out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(self.proc.pid)],
                             capture_output=True, text=True, check=False).stdout
        found = {}
        for line in out.splitlines():
            pid, _, args = line.strip().partition(" ")
            found[args] = int(pid)
        return found

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Callable[..., Up]]:
    started: list[Up] = []

    def start(*extra: str, **env_extra: str) -> Up:
        u = Up(tmp_path, free_port(), *extra, env_extra=env_extra)
        started.append(u)
        return u

    yield start
    for u in started:
        if u.proc.poll() is None:
            u.proc.kill()
            u.proc.wait(30)


def allowed_cpus(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


def test_up_serves_a_stream_pins_the_lanes_and_stops_on_sigterm(
    up: Callable[..., Up], speech: Callable[..., Path], tmp_path: Path
) -> None:
    u = up()
    u.wait_for("Ctrl-C stops everything.")
    banner = u.out.read_text()
    assert f"http://127.0.0.1:{u.port}" in banner
    assert f"ws://127.0.0.1:{u.port}/v1/stream" in banner
    kids = u.children()
    by_role = {role: pid for args, pid in kids.items()
               for role in ("redis-server", "gateway", "--lane realtime", "--lane batch")
               if role in args}
    assert set(by_role) == {"redis-server", "gateway", "--lane realtime", "--lane batch"}
    if len(os.sched_getaffinity(0)) >= 2:
        realtime = allowed_cpus(by_role["--lane realtime"])
        batch = allowed_cpus(by_role["--lane batch"])
        assert realtime.isdisjoint(batch)
        assert allowed_cpus(by_role["gateway"]) == realtime

    result = subprocess.run(
        [PY, "-m", "lanegate.cli", "stream", str(speech(ONE)), "--url",
         f"http://127.0.0.1:{u.port}", "--speed", "4"],
        capture_output=True, timeout=120, check=False)
    stdout = result.stdout.decode()  # bytes: universal newlines would turn \r into \n
    assert result.returncode == 0, result.stderr
    finals = [line.split("\r")[-1].strip() for line in stdout.split("\n")]
    assert recall(ONE, " ".join(finals)) >= SENTENCE_RECALL, stdout
    assert "\r" not in stdout  # piped: one line per final (test_client_usage: on a terminal)

    assert u.stop() == 0
    for pid in kids.values():
        assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid)
    assert any((tmp_path / "data" / "redis").rglob("*.aof*")), "AOF is on"


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_up_restarts_a_crashed_worker(up: Callable[..., Up]) -> None:
    u = up()
    u.wait_for("Ctrl-C stops everything.")
    victim = next(pid for args, pid in u.children().items() if "--lane realtime" in args)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while '"child_exited"' not in u.err.read_text() or not any(
        "--lane realtime" in a and p != victim for a, p in u.children().items()
    ):
        assert time.monotonic() < deadline, u.err.read_text()[-3000:]
        time.sleep(0.2)
    assert '"child": "worker-realtime"' in u.err.read_text()
    assert u.stop() == 0


def test_up_with_a_child_failing_at_start_exits_non_zero(up: Callable[..., Up]) -> None:
    import socket

    # the workers' internal port is taken, so they die while binding it
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        u = up("--worker-port", str(busy.getsockname()[1]))
        code = u.proc.wait(120)
    assert code == 1
    assert "during start" in u.err.read_text()
    assert not u.children()


def test_up_refuses_bad_settings_before_starting_anything(up: Callable[..., Up]) -> None:
    u = up("--engine", "no-such-engine")
    assert u.proc.wait(60) == 2
    assert "LANEGATE_ENGINE" in u.err.read_text()
    assert not u.children()


def test_up_refuses_a_busy_port(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        u = Up(tmp_path, busy.getsockname()[1])
        assert u.proc.wait(60) == 1
    assert "already in use" in u.err.read_text()


# --- the supervisor dies --------------------------------------------------------------------

#: the simulated engine at about 0.2 s per audio second: a 60 s job takes about 12 s
SLOW_BATCH = {"LANEGATE_ENGINE": "simulated", "LANEGATE_SIM_PREFILL_FRAME_MS": "2.0",
              "LANEGATE_MAX_WINDOW_S": "5", "LANEGATE_SOFT_CUT_SEARCH_S": "2",
              "LANEGATE_BATCH_MAX_AUDIO_S": "5", "LANEGATE_BATCH_WINDOW_S": "5"}


def long_wav(speech: Callable[..., Path], out: Path, seconds: float) -> Path:
    with wave.open(str(speech(ONE))) as src:
        frames = src.readframes(src.getnframes())
    with wave.open(str(out), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(frames * int(seconds * 32000 // len(frames) + 1))
    return out


async def _submit_and_wait_until_processing(base: str, wav: bytes) -> str:
    async with aiohttp.ClientSession(base_url=base) as http:
        data = aiohttp.FormData()
        data.add_field("file", wav, filename="long.wav", content_type="audio/wav")
        async with http.post("/v1/transcriptions", data=data) as response:
            assert response.status == 202, await response.text()
            job_id = str((await response.json())["id"])
        for _ in range(600):
            async with http.get(f"/v1/transcriptions/{job_id}") as response:
                job = await response.json()
            if job["status"] == "processing" and job["progress"] > 0:
                return job_id
            await asyncio.sleep(0.05)
    raise AssertionError(f"the job never made progress: {job}")


def test_a_sigkilled_up_stops_its_children_in_order_and_hands_the_job_back(
    up: Callable[..., Up], speech: Callable[..., Path], tmp_path: Path
) -> None:
    u = up(**SLOW_BATCH)
    u.wait_for("Ctrl-C stops everything.")
    kids = u.children()
    job_id = asyncio.run(_submit_and_wait_until_processing(
        f"http://127.0.0.1:{u.port}", long_wav(speech, tmp_path / "long.wav", 60).read_bytes()))
    u.proc.kill()
    u.proc.wait(30)
    deadline = time.monotonic() + 120
    while any(Path(f"/proc/{pid}").exists() and not _is_zombie(pid) for pid in kids.values()):
        assert time.monotonic() < deadline, "the children outlived their supervisor"
        time.sleep(0.2)
    # the job, as Redis wrote it to its AOF before it stopped
    port = free_port()
    data = tmp_path / "data" / "redis"
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--dir", str(data), "--appendonly", "yes", "--save", ""],
                              stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, decode_responses=True)
        for _ in range(100):
            with contextlib.suppress(redis.exceptions.ConnectionError):
                if client.ping():
                    break
            time.sleep(0.05)
        job = client.hgetall(f"lanegate:job:{job_id}")
        assert (job["status"], job["attempts"]) == ("queued", "0"), \
            "handed back by the stop: not charged an attempt"
        client.close()
    finally:
        server.terminate()
        server.wait(30)
    log = u.err.read_text(errors="replace")
    stops = [json.loads(line)["child"] for line in log.splitlines()
             if '"orphan_stop"' in line]
    assert sorted(stops[:2]) == ["worker-batch", "worker-realtime"], stops
    assert stops[2:] == ["gateway", "redis"], "the gateway after the workers, Redis last"
    assert '"job_handed_back"' in log
    assert '"job_hand_back_failed"' not in log
    assert '"orphan_killed"' not in log, "every child stopped within stop_timeout_s"
