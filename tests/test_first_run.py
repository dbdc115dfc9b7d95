"""``lanegate up`` as a newcomer meets it: a banner that names the data directory and
the jobs already queued in it, and a Ctrl-C that logs no warning and ends with one
human line. Real processes: redis-server, the gateway, ``lanegate up`` itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import RedisServer, free_port
from phrases import RAIN
from stack import REPO
from stack import lone_gateway as gateway_process

from lanegate.settings import Settings
from lanegate.supervisor import banner, queued_jobs

PY = sys.executable


@pytest.fixture
def lone_gateway(tmp_path: Path, redis_server: RedisServer) -> Iterator[str]:
    """A real gateway with Redis and no worker: queued jobs stay queued."""
    with gateway_process(tmp_path, redis_server.url, LANEGATE_DATA_DIR=str(tmp_path / "data"),
                         LANEGATE_STATUS_SAMPLE_S="0") as url:  # every /status.json read fresh
        yield url


def queue_job(url: str, wav: Path) -> str:
    request = urllib.request.Request(f"{url}/v1/transcriptions?async=true",
                                     data=wav.read_bytes(), method="POST",
                                     headers={"Content-Type": "audio/wav"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.status == 202
        return str(json.load(resp)["id"])


def test_the_banner_names_the_data_dir_and_the_jobs_waiting_in_it(
        lone_gateway: str, speech: Callable[..., Path], tmp_path: Path) -> None:
    assert queued_jobs(lone_gateway) == "none"
    wav = speech(RAIN)
    queue_job(lone_gateway, wav)
    queue_job(lone_gateway, wav)
    queued = queued_jobs(lone_gateway)
    assert queued.startswith("2 from an earlier run"), queued
    assert "new jobs wait behind them" in queued
    text = banner(Settings(data_dir=str(tmp_path / "data")), queued)
    assert f"data dir   {tmp_path / 'data'}" in text
    assert "queued     2 from an earlier run" in text
    down = queued_jobs(f"http://127.0.0.1:{free_port()}")
    assert down.startswith("unknown (cannot read")


def test_ctrl_c_logs_no_warning_and_ends_with_one_human_line(
        tmp_path: Path, speech: Callable[..., Path]) -> None:
    port = free_port()
    out, err = tmp_path / "up.out", tmp_path / "up.err"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LANEGATE_")}
    env.update(LANEGATE_SLOTS="2", LANEGATE_ENGINE="simulated")
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        up = subprocess.Popen([PY, "-m", "lanegate.cli", "up", "--port", str(port),
                               "--data-dir", str(tmp_path / "data")],
                              stdout=stdout, stderr=stderr, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while "Ctrl-C stops everything." not in out.read_text():
            assert up.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.2)
        text = out.read_text()
        assert f"data dir   {tmp_path / 'data'}" in text
        assert "queued     none" in text
        assert f"status     http://127.0.0.1:{port}/status" in text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=10) as r:
            status = json.load(r)
        assert sorted(status["lanes"]) == ["batch", "realtime"]
        assert status["lanes"]["realtime"]["free_slots"] == 2
        assert status["split"]["sentence"].startswith("The lanes are split")
        # a stream opens the gateway's link to the realtime worker, which Ctrl-C closes
        streamed = subprocess.run(
            [PY, "-m", "lanegate.cli", "stream", str(speech(RAIN)), "--speed", "0",
             "--url", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60,
            check=False, cwd=REPO)
        assert streamed.returncode == 0, streamed.stderr
        up.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(30)
    events = [json.loads(line) for line in err.read_text().splitlines()
              if line.startswith("{")]
    stop = next(i for i, e in enumerate(events) if e["event"] == "stop_requested")
    after = [e for e in events[stop:] if e["level"] not in ("info", "debug")]
    assert after == [], after
    assert any(e["event"] == "worker_link_closed" for e in events[stop:])
    last = out.read_text().strip().splitlines()[-1]
    assert last == ("lanegate stopped: redis, gateway, worker-realtime, worker-batch "
                    "exited cleanly."), last
