"""Liveness both ways on the gateway-worker link, the step watchdog, and several realtime
workers under ``lanegate up``.

* A worker frees every slot of a gateway it has not heard from for ``link_timeout_s``:
  raw WebSocket clients on ``/internal/v1/link`` and ``/internal/v1/session`` that stop
  answering (no pong, nothing sent) lose their sessions; one that stays alive keeps
  them.
* A gateway declares a SIGSTOPped worker process lost within ``link_timeout_s`` even
  when ``worker_lost_timeout_s`` is longer.
* A step that hangs past ``step_stall_s``: the worker answers ``/readyz`` 503, leaves
  the registry, refuses new sessions, and as a process exits with ``EXIT_STALLED``.

Real redis-server, real ``RealtimeWorker`` (in-process and as ``lanegate worker``),
the simulated engine, espeak-ng speech, real aiohttp clients.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from aiohttp import web
from conftest import RedisServer, free_port, read_pcm
from phrases import SHORT

from engines.base import EngineStream, Hypothesis
from engines.simulated import SimulatedEngine
from gateway.app import create_app
from gateway.links import silence_limit_s
from lanegate.settings import Settings
from lanegate.supervisor import realtime_children
from lanes.registry import list_workers
from workers.realtime import RealtimeWorker
from workers.watchdog import EXIT_STALLED

REPO = Path(__file__).resolve().parent.parent
SLOTS = 4
#: short, so that the tests wait seconds; the default is 10 s
LINK_TIMEOUT_S = 2.0
#: slack over a deadline for a loaded machine (the bound only catches a missing detection)
SLACK_S = 1.5
FRAME = 3200  # 100 ms at 16 kHz


@pytest_asyncio.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture(scope="module")
def pcm(speech: Callable[..., Path]) -> bytes:
    return read_pcm(speech(SHORT))[0]


class HangingEngine(SimulatedEngine):
    """The simulated engine whose steps hang (GIL released, as in a stuck GPU call)
    until ``release`` is set: a fault the test injects."""

    def __init__(self, settings: Settings, *, slots: int) -> None:
        super().__init__(settings, slots=slots)
        self.release = threading.Event()

    def step(self, work: Sequence[tuple[EngineStream, bytes]]) -> list[Hypothesis]:
        self.release.wait()
        return super().step(work)


@pytest_asyncio.fixture
async def worker_factory(redis_client: aioredis.Redis
                         ) -> AsyncIterator[Callable[..., Any]]:
    started: list[RealtimeWorker] = []

    async def start(engine_class: type[SimulatedEngine] = SimulatedEngine,
                    **changes: Any) -> RealtimeWorker:
        settings = Settings(engine="simulated", worker_id=f"rt-{len(started)}",
                            heartbeat_s=0.2, link_timeout_s=LINK_TIMEOUT_S, **changes)
        worker = RealtimeWorker(settings, engine_class(settings, slots=SLOTS), redis_client)
        await worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if isinstance(worker.engine, HangingEngine):
            worker.engine.release.set()
        await worker.stop()


async def until(predicate: Callable[[], Any], timeout_s: float, what: str) -> float:
    """Seconds until ``predicate()`` holds (awaiting it if it is a coroutine)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic() - started
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what} not within {timeout_s} s")


async def open_link(http: aiohttp.ClientSession, worker: RealtimeWorker, channels: int,
                    ) -> aiohttp.ClientWebSocketResponse:
    """A raw link (no automatic pongs) with ``channels`` sessions accepted on it."""
    ws = await http.ws_connect(worker.url + "/internal/v1/link", autoping=False)
    hello = await ws.receive_json(timeout=5)
    assert hello["type"] == "link"
    for ch in range(channels):
        await ws.send_str(json.dumps({"op": "open", "ch": ch, "session_id": f"s{id(ws)}-{ch}",
                                      "sample_rate": 16000}))
    accepted = 0
    while accepted < channels:
        msg = await ws.receive(timeout=5)
        assert msg.type is aiohttp.WSMsgType.TEXT, msg
        accepted += sum(1 for _, event in json.loads(msg.data) if event["type"] == "accepted")
    return ws


async def registered_free(redis: aioredis.Redis, worker_id: str) -> int | None:
    for info in await list_workers(redis, "realtime"):
        if info.worker_id == worker_id:
            return info.slots_free
    return None


async def registered_is(redis: aioredis.Redis, worker_id: str, free: int) -> bool:
    return await registered_free(redis, worker_id) == free


# --- the worker hears nothing from its gateway ---------------------------------------


async def test_a_worker_frees_the_slots_of_a_silent_gateway_link_and_keeps_a_live_ones(
    worker_factory: Callable[..., Any], redis_client: aioredis.Redis,
) -> None:
    worker = await worker_factory()
    async with aiohttp.ClientSession() as http:
        live = await open_link(http, worker, 1)
        # the live gateway answers pings (a reader with aiohttp's automatic pongs)
        live_reader = asyncio.create_task(_answer_pings(live))
        silent = await open_link(http, worker, 2)
        assert worker.engine.slots_free() == SLOTS - 3
        went_silent = time.monotonic()

        freed = await until(lambda: worker.engine.slots_free() == SLOTS - 1,
                            LINK_TIMEOUT_S + SLACK_S, "the silent gateway's slots freed")
        assert freed <= LINK_TIMEOUT_S + SLACK_S
        await until(lambda: registered_is(redis_client, worker.worker_id, SLOTS - 1),
                    5, "the registry shows the slots free again")
        # the gateway that is alive but sends nothing keeps its session well past it
        await asyncio.sleep(max(0.0, went_silent + 2 * LINK_TIMEOUT_S - time.monotonic()))
        assert worker.engine.slots_free() == SLOTS - 1
        assert not live.closed
        live_reader.cancel()
        await live.close()
        await silent.close()
    print(f"silent link dropped {freed:.2f} s after its last message "
          f"(link_timeout_s {LINK_TIMEOUT_S})")


async def _answer_pings(ws: aiohttp.ClientWebSocketResponse) -> None:
    while not ws.closed:
        msg = await ws.receive()
        if msg.type is aiohttp.WSMsgType.PING:
            await ws.pong(msg.data)
        elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                          aiohttp.WSMsgType.ERROR):
            return


async def test_a_worker_frees_the_slot_of_a_silent_session_socket(
    worker_factory: Callable[..., Any], pcm: bytes,
) -> None:
    worker = await worker_factory()
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(
            worker.url + "/internal/v1/session?session_id=quiet&sample_rate=16000",
            autoping=False)
        assert (await ws.receive_json(timeout=5))["type"] == "accepted"
        await ws.send_bytes(pcm[:10 * FRAME])
        assert worker.engine.slots_free() == SLOTS - 1
        freed = await until(lambda: worker.engine.slots_free() == SLOTS,
                            LINK_TIMEOUT_S + SLACK_S, "the silent session's slot freed")
        await ws.close()
    assert freed <= LINK_TIMEOUT_S + SLACK_S


# --- the gateway hears nothing from its worker ---------------------------------------


@pytest.fixture
def spawn_worker(redis_server: RedisServer, tmp_path: Path
                 ) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """``spawn(worker_id, **settings)``: ``lanegate worker --lane realtime`` (simulated
    engine) as its own process, logging to ``tmp_path/<worker_id>.log``."""
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(worker_id: str, **changes: Any) -> subprocess.Popen[bytes]:
        settings = Settings(redis_url=redis_server.url, engine="simulated",
                            worker_id=worker_id, worker_port=free_port(), heartbeat_s=0.2,
                            slots=SLOTS, **changes)
        with (tmp_path / f"{worker_id}.log").open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "lanegate.cli", "worker", "--lane", "realtime"],
                cwd=REPO, env={**os.environ, **settings.to_env()}, stdout=log, stderr=log)
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(30)


def worker_url(log: Path) -> str:
    for line in log.read_text().splitlines():
        if line.startswith("{") and '"worker_started"' in line:
            return str(json.loads(line)["url"])
    raise AssertionError(f"no worker_started in {log}")


async def test_a_gateway_declares_a_stopped_worker_lost_within_link_timeout(
    redis_server: RedisServer, redis_client: aioredis.Redis,
    spawn_worker: Callable[..., subprocess.Popen[bytes]], pcm: bytes,
) -> None:
    worker_process = spawn_worker("proc-1")
    # worker_lost_timeout_s alone would wait 30 s; link_timeout_s bounds it
    settings = Settings(redis_url=redis_server.url, worker_lost_timeout_s=30.0,
                        link_timeout_s=LINK_TIMEOUT_S)
    assert silence_limit_s(settings, "realtime") < LINK_TIMEOUT_S
    runner = web.AppRunner(create_app(settings), shutdown_timeout=5)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await until(lambda: registered_free(redis_client, "proc-1"), 60, "worker registered")
        async with aiohttp.ClientSession() as http, http.ws_connect(
                f"ws://127.0.0.1:{port}/v1/stream?sample_rate=16000") as ws:
            assert (await ws.receive_json(timeout=10))["type"] == "ready"
            for offset in range(0, 10 * FRAME, FRAME):
                await ws.send_bytes(pcm[offset:offset + FRAME])
            os.kill(worker_process.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            events = []
            async for msg in ws:
                if msg.type is aiohttp.WSMsgType.TEXT:
                    events.append(json.loads(msg.data))
            waited = time.monotonic() - stopped
            assert events[-1]["type"] == "error", events
            assert events[-1]["code"] == "worker_lost"
            assert ws.close_code == 1011
            assert waited <= LINK_TIMEOUT_S + SLACK_S, waited
    finally:
        await runner.cleanup()


# --- the step watchdog ---------------------------------------------------------------


async def test_a_hung_step_takes_the_worker_out_of_service(
    worker_factory: Callable[..., Any], redis_client: aioredis.Redis, pcm: bytes,
) -> None:
    worker = await worker_factory(HangingEngine, step_stall_s=0.5)
    await until(lambda: registered_free(redis_client, worker.worker_id), 5, "registered")
    async with aiohttp.ClientSession() as http:
        async with http.get(worker.url + "/readyz") as resp:
            assert resp.status == 200
        ws = await http.ws_connect(
            worker.url + "/internal/v1/session?session_id=hung&sample_rate=16000")
        assert (await ws.receive_json(timeout=5))["type"] == "accepted"
        for offset in range(0, 20 * FRAME, FRAME):
            await ws.send_bytes(pcm[offset:offset + FRAME])
        await asyncio.wait_for(worker.stalled.wait(), 30)
        assert worker.stall_s is not None
        assert worker.stall_s > 0.5

        async with http.get(worker.url + "/readyz") as resp:
            assert resp.status == 503
            assert (await resp.json())["status"] == "stalled"
        async with http.get(worker.url + "/healthz") as resp:
            assert resp.status == 200  # the process answers until it exits
        await asyncio.sleep(3 * worker.settings.heartbeat_s)  # heartbeats would re-add it
        assert await registered_free(redis_client, worker.worker_id) is None
        other = await http.ws_connect(
            worker.url + "/internal/v1/session?session_id=late&sample_rate=16000")
        refusal = await other.receive_json(timeout=5)
        assert (refusal["type"], refusal["code"]) == ("error", "overloaded")
        await other.close()
        await ws.close()


async def test_a_worker_process_with_a_hung_step_exits_for_its_supervisor(
    redis_client: aioredis.Redis, spawn_worker: Callable[..., subprocess.Popen[bytes]],
    tmp_path: Path, pcm: bytes,
) -> None:
    # a step of the simulated engine that sleeps ten minutes: a hung engine call
    proc = spawn_worker("stuck", step_stall_s=1.0, sim_step_fixed_ms=600_000.0)
    log_path = tmp_path / "stuck.log"
    await until(lambda: registered_free(redis_client, "stuck"), 60, "worker registered")
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(worker_url(log_path) +
                                   "/internal/v1/session?session_id=x&sample_rate=16000")
        assert (await ws.receive_json(timeout=5))["type"] == "accepted"
        for offset in range(0, 20 * FRAME, FRAME):
            await ws.send_bytes(pcm[offset:offset + FRAME])
        code = await asyncio.to_thread(proc.wait, 60)
        await ws.close()
    assert code == EXIT_STALLED
    assert await registered_free(redis_client, "stuck") is None
    logged = [json.loads(line) for line in log_path.read_text().splitlines()
              if line.startswith("{")]
    stalled = [e for e in logged if e.get("event") == "step_stalled"]
    assert len(stalled) == 1
    assert stalled[0]["step_s"] > 1.0


# --- several realtime workers under `lanegate up` --------------------------------------


def test_realtime_children_get_their_own_ids_ports_and_cpus() -> None:
    env = {"LANEGATE_WORKER_ID": "rt", "LANEGATE_WORKER_PORT": "9000"}
    (one,) = realtime_children(Settings(), env, frozenset({0, 1}))
    assert (one.name, one.cpus, one.env) == ("worker-realtime", frozenset({0, 1}), env)

    three = realtime_children(Settings(realtime_workers=3, worker_id="rt", worker_port=9000),
                              env, frozenset({0, 1, 2, 3}))
    assert [c.name for c in three] == [f"worker-realtime-{i}" for i in range(3)]
    assert [c.env["LANEGATE_WORKER_ID"] for c in three] == ["rt-0", "rt-1", "rt-2"]
    assert [c.env["LANEGATE_WORKER_PORT"] for c in three] == ["9000", "9001", "9002"]
    assert [c.cpus for c in three] == [frozenset({0, 1}), frozenset({2}), frozenset({3})]
    assert all("--lane" in c.argv and "realtime" in c.argv for c in three)

    # fewer cores than workers: they share the realtime half; default ids and ports
    # (host-pid, a free port) are already distinct
    shared = realtime_children(Settings(realtime_workers=2), {}, frozenset({0}))
    assert [c.cpus for c in shared] == [frozenset({0})] * 2
    assert all("LANEGATE_WORKER_ID" not in c.env for c in shared)
    assert realtime_children(Settings(realtime_workers=2), {}, None)[1].cpus is None


def test_realtime_workers_must_be_positive() -> None:
    from lanegate.settings import SettingsError

    with pytest.raises(SettingsError, match="LANEGATE_REALTIME_WORKERS"):
        Settings(realtime_workers=0)


def test_up_with_two_realtime_workers_registers_both(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "LANEGATE_ENGINE": "simulated", "LANEGATE_SLOTS": "2"}
    env.pop("LANEGATE_REDIS_URL", None)
    with (tmp_path / "up.err").open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lanegate.cli", "up", "--port", str(port),
             "--data-dir", str(tmp_path / "data"), "--realtime-workers", "2"],
            stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        ready: dict[str, Any] = {}
        while ready.get("realtime_workers") != 2:
            assert proc.poll() is None, (tmp_path / "up.err").read_text()[-3000:]
            assert time.monotonic() < deadline, ready
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz",
                                            timeout=2) as resp:
                    ready = json.loads(resp.read())
            except OSError:
                pass
            time.sleep(0.2)
        assert ready["free_slots"] == 4
        started = [json.loads(line) for line in (tmp_path / "up.err").read_text().splitlines()
                   if line.startswith("{") and '"child_start"' in line]
        assert {e["child"] for e in started} >= {"worker-realtime-0", "worker-realtime-1"}
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0
