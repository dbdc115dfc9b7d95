"""Live observability: the real processes, a real Prometheus scraping them, real traffic.

Starts redis-server, the gateway, a realtime worker (pocketsphinx, one short real
stream) and a batch worker as ``python -m lanegate.cli`` subprocesses, and a
``prometheus`` (Debian's package) on a free port scraping the three at a 1 s interval
with the shipped alert rules. After a WebSocket stream, a refused stream and an async
upload, every query of every shipped dashboard panel and every alert expression is
evaluated through Prometheus's HTTP API: each must parse and return series (alerts
whose threshold is not breached are evaluated without the ``<op> <threshold>`` part).
A panel or alert naming a metric no process exports fails here. It also checks the
label contract (``lane`` everywhere, ``worker`` on worker series) and that every
process logs JSON lines, with no per-frame events at the default level.
"""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from conftest import RedisServer, read_pcm
from deploy_support import (
    ALERTS_YML,
    PROMETHEUS_YML,
    ROOT,
    alert_rules,
    defined_metrics,
    expand_macros,
    metric_names,
    panel_queries,
    without_threshold,
)

from lanegate.supervisor import Child, Supervisor, free_port, http_ready, lanegate_argv

PROMETHEUS = shutil.which("prometheus")
MISSING = [m for m in ("gateway.app", "workers.main") if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.skipif(PROMETHEUS is None,
                       reason="prometheus missing (apt-get install prometheus)"),
    pytest.mark.skipif(bool(MISSING), reason=f"process modules not built yet: {MISSING}"),
    pytest.mark.timeout(240),
]

#: which scrape job must export which metric family (see lanegate/metrics.py)
EXPECTED_EXPORTERS: dict[str, set[str]] = {
    "lanegate_first_partial_seconds": {"gateway"},
    "lanegate_partial_latency_seconds": {"gateway"},
    "lanegate_final_latency_seconds": {"gateway"},
    "lanegate_rejections_total": {"gateway"},
    "lanegate_failovers_total": {"gateway"},
    "lanegate_queue_depth": {"gateway"},
    "lanegate_queue_oldest_age_seconds": {"gateway"},
    "lanegate_workers": {"gateway"},
    "lanegate_jobs_total": {"gateway", "batch-worker"},
    "lanegate_step_duration_seconds": {"realtime-worker", "batch-worker"},
    "lanegate_realtime_factor": {"realtime-worker", "batch-worker"},
    "lanegate_audio_seconds_total": {"realtime-worker", "batch-worker"},
    "lanegate_soft_cuts_total": {"realtime-worker", "batch-worker"},
    "lanegate_active_sessions": {"realtime-worker"},
    "lanegate_free_slots": {"realtime-worker"},
    "lanegate_event_loop_lag_seconds": {"realtime-worker"},
    "lanegate_live_stall_seconds": {"realtime-worker"},
    "lanegate_long_prefill_seconds_total": {"realtime-worker"},
    "lanegate_job_duration_seconds": {"batch-worker"},
    "lanegate_queue_wait_seconds": {"batch-worker"},
}

SENTENCE = "the quick brown fox jumps over the lazy dog"
FRAME_MS = 100
#: how long the test waits for a scrape or a rule evaluation to reflect the traffic
SETTLE_S = 30.0
#: how long the four processes may take to be ready
START_TIMEOUT_S = 120.0


@dataclass
class Stack:
    gateway_url: str
    ports: dict[str, int]
    prometheus_url: str
    supervisor: Supervisor
    session_id: str = ""
    job_id: str = ""

    @property
    def procs(self) -> list[Child]:
        return self.supervisor.children

    def logs(self) -> str:
        return self.supervisor.log_tails()


def prometheus_config(ports: dict[str, int]) -> dict[str, Any]:
    """deploy/prometheus.yml's jobs, pointed at the local processes, scraped every second."""
    shipped = {job["job_name"] for job in yaml.safe_load(PROMETHEUS_YML.read_text())[
        "scrape_configs"]}
    assert set(ports) == shipped, f"the live stack scrapes {set(ports)}, compose {shipped}"
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                   "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS_YML)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for job, port in ports.items()
        ],
    }


@pytest.fixture
def stack(redis_server: RedisServer, tmp_path: Path) -> Iterator[Stack]:
    ports = {"gateway": free_port(), "realtime-worker": free_port(),
             "batch-worker": free_port()}
    prom_port = free_port()
    env = {
        **os.environ,
        "LANEGATE_REDIS_URL": redis_server.url,
        "LANEGATE_DATA_DIR": str(tmp_path / "data"),
        "LANEGATE_BLOB_DIR": str(tmp_path / "blobs"),
        "LANEGATE_LOG_LEVEL": "info",
        "LANEGATE_API_KEYS": "",
        "LANEGATE_WORKER_HOST": "127.0.0.1",
        "LANEGATE_HEARTBEAT_S": "0.5",
        "LANEGATE_CLAIM_IDLE_S": "30",
    }
    def child(name: str, argv: list[str], child_env: dict[str, str], order: int) -> Child:
        return Child(name, argv, child_env, log=tmp_path / f"{name}.log", cwd=str(ROOT),
                     stop_order=order)

    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(ports)))
    assert PROMETHEUS is not None
    gateway_url = f"http://127.0.0.1:{ports['gateway']}"
    prometheus_url = f"http://127.0.0.1:{prom_port}"
    children = [
        child("realtime-worker", lanegate_argv(
            "worker", "--lane", "realtime", "--engine", "pocketsphinx", "--slots", "2",
            "--worker-port", str(ports["realtime-worker"]),
        ), {**env, "LANEGATE_WORKER_ID": "rt-obs"}, 0),
        child("batch-worker", lanegate_argv(
            "worker", "--lane", "batch", "--engine", "pocketsphinx",
            "--worker-port", str(ports["batch-worker"]),
        ), {**env, "LANEGATE_WORKER_ID": "batch-obs"}, 0),
        child("gateway", lanegate_argv(
            "gateway", "--host", "127.0.0.1", "--port", str(ports["gateway"]),
        ), env, 1),
        child("prometheus", [
            PROMETHEUS, f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ], dict(os.environ), 2),
    ]
    probes = [http_ready(f"http://127.0.0.1:{ports['realtime-worker']}/healthz"),
              http_ready(f"http://127.0.0.1:{ports['batch-worker']}/healthz"),
              http_ready(f"{gateway_url}/readyz"), http_ready(f"{prometheus_url}/-/ready")]
    supervisor = Supervisor(children, ready=lambda: all(probe() for probe in probes),
                            start_timeout_s=START_TIMEOUT_S, stop_timeout_s=20.0)
    try:
        supervisor.start_all()
        yield Stack(gateway_url, ports, prometheus_url, supervisor)
    finally:
        supervisor.stop_all()


# --- Prometheus HTTP API ---------------------------------------------------------------


async def query(http: aiohttp.ClientSession, base: str, expr: str) -> list[dict[str, Any]]:
    """Instant query; raises AssertionError when Prometheus cannot parse or run it."""
    async with http.get(f"{base}/api/v1/query", params={"query": expr}) as resp:
        body = await resp.json()
    assert body.get("status") == "success", f"{expr}\n{body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


async def until_series(
    http: aiohttp.ClientSession, base: str, expr: str,
    enough: Callable[[list[dict[str, Any]]], bool] = bool,
) -> list[dict[str, Any]]:
    """Evaluate until the result is ``enough`` (default: any series) or SETTLE_S passes
    (scrapes are 1 s apart; this waits for data, it asserts nothing about speed)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        result = await query(http, base, expr)
        if enough(result) or time.monotonic() > deadline:
            return result
        await asyncio.sleep(1.0)


def _jobs(result: list[dict[str, Any]]) -> set[str]:
    return {r["metric"].get("job", "") for r in result}


# --- traffic ---------------------------------------------------------------------------


async def stream_speech(base: str, pcm: bytes, rate: int) -> list[dict[str, Any]]:
    """One stream paced at real time, followed by silence so the VAD endpoints it."""
    ws_url = base.replace("http://", "ws://") + f"/v1/stream?sample_rate={rate}&language=en"
    frame = rate * 2 * FRAME_MS // 1000
    audio = pcm + bytes(rate * 2)  # 1 s of trailing silence
    events: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url) as ws:
        first = await ws.receive_json(timeout=30)
        assert first["type"] == "ready", first
        events.append(first)

        async def reader() -> None:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                event = json.loads(msg.data)
                events.append(event)
                if event["type"] in ("done", "error"):
                    break

        task = asyncio.create_task(reader())
        try:
            for start in range(0, len(audio), frame):
                if task.done():
                    break  # the server ended the stream early: the events say why
                await ws.send_bytes(audio[start:start + frame])
                await asyncio.sleep(FRAME_MS / 1000)
            await ws.send_json({"type": "end"})
        except aiohttp.ClientConnectionResetError:
            pass
        await asyncio.wait_for(task, timeout=60)
    return events


async def refused_stream(base: str) -> dict[str, Any]:
    """A stream with an impossible sample rate: refused with an error event."""
    ws_url = base.replace("http://", "ws://") + "/v1/stream?sample_rate=1234"
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url) as ws:
        event: dict[str, Any] = await ws.receive_json(timeout=30)
    return event


async def batch_job(base: str, wav_bytes: bytes) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        form = aiohttp.FormData()
        form.add_field("file", wav_bytes, filename="speech.wav",
                       content_type="audio/wav")
        form.add_field("async", "true")
        async with http.post(f"{base}/v1/transcriptions", data=form) as resp:
            assert resp.status == 202, await resp.text()
            job: dict[str, Any] = await resp.json()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            async with http.get(f"{base}/v1/transcriptions/{job['id']}") as resp:
                job = await resp.json()
            if job["status"] in ("completed", "failed", "cancelled"):
                return job
            await asyncio.sleep(0.5)
    raise AssertionError(f"job did not finish: {job}")


# --- the test ----------------------------------------------------------------------------


def test_every_panel_and_alert_returns_series(
    stack: Stack, speech: Callable[..., Path]
) -> None:
    wav = speech(SENTENCE)
    pcm, rate = read_pcm(wav)
    try:
        asyncio.run(_exercise(stack, pcm, rate, wav.read_bytes()))
        _check_logs(stack)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stack.logs()}") from exc


async def _exercise(stack: Stack, pcm: bytes, rate: int, wav_bytes: bytes) -> None:
    base, prom = stack.gateway_url, stack.prometheus_url
    async with aiohttp.ClientSession() as http:
        # every process is scraped before the traffic, so rates see the increase
        for scrape_job in stack.ports:
            up = await until_series(http, prom, f'up{{job="{scrape_job}"}} == 1')
            assert up, f"Prometheus cannot scrape {scrape_job}\n" + stack.logs()

        events = await stream_speech(base, pcm, rate)
        kinds = collections.Counter(e["type"] for e in events)
        assert kinds["partial"] >= 1, events
        assert kinds["final"] >= 1, events
        assert events[-1]["type"] == "done", events
        session_id = events[0]["session_id"]

        refused = await refused_stream(base)
        assert refused["type"] == "error", refused

        job = await batch_job(base, wav_bytes)
        assert job["status"] == "completed", job
        stack.session_id, stack.job_id = session_id, job["id"]

        # every metric family is exported by the processes that own it
        missing = []
        for family, jobs in EXPECTED_EXPORTERS.items():
            sample = family + ("_count" if f"{family}_bucket" in defined_metrics() else "")

            def covers(result: list[dict[str, Any]], wanted: set[str] = jobs) -> bool:
                return wanted <= _jobs(result)

            found = await until_series(http, prom, f"count by (job) ({sample})", covers)
            exporters = _jobs(found)
            if not jobs <= exporters:
                missing.append(f"{family}: expected from {sorted(jobs)}, "
                               f"exported by {sorted(exporters)}")
        if missing:
            exposition = []
            for scrape_job, port in stack.ports.items():
                async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    text = await resp.text()
                exposition += [f"{scrape_job}: {line}" for line in text.splitlines()
                               if line.startswith("lanegate_") and "_bucket" not in line]
            raise AssertionError("metrics not exported:\n" + "\n".join(missing)
                                 + "\n/metrics now:\n" + "\n".join(exposition))

        # the label contract: lane on every series, worker on every worker series
        no_lane = await query(http, prom, '{__name__=~"lanegate_.+", lane=""}')
        assert not no_lane, [r["metric"] for r in no_lane]
        no_worker = await query(
            http, prom, '{__name__=~"lanegate_.+", job=~".+-worker", worker=""}')
        assert not no_worker, [r["metric"] for r in no_worker]

        # every dashboard query returns series
        empty = []
        for where, expr in panel_queries():
            if not await until_series(http, prom, expand_macros(expr)):
                empty.append(f"{where}: {expr} (metrics {sorted(metric_names(expr))})")
        assert not empty, "dashboard queries without series:\n" + "\n".join(empty)

        # every alert parses as written, and what it compares returns series
        for rule in alert_rules():
            await query(http, prom, rule["expr"])
            inner = without_threshold(rule["expr"])
            assert await until_series(http, prom, inner), f"{rule['alert']}: {inner}"

        # Prometheus loaded the shipped rules and evaluates them without errors
        async with http.get(f"{prom}/api/v1/rules") as resp:
            groups = (await resp.json())["data"]["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        assert set(loaded) == {r["alert"] for r in alert_rules()}
        deadline = time.monotonic() + SETTLE_S
        while any(r.get("health") != "ok" for r in loaded.values()):
            assert time.monotonic() < deadline, {n: r.get("lastError") for n, r in loaded.items()}
            await asyncio.sleep(1.0)
            async with http.get(f"{prom}/api/v1/rules") as resp:
                groups = (await resp.json())["data"]["groups"]
            loaded = {r["name"]: r for g in groups for r in g["rules"]}


def _check_logs(stack: Stack) -> None:
    session_id, job_id = stack.session_id, stack.job_id
    seen_session = seen_job = False
    problems = []
    for proc in stack.procs:
        if proc.name == "prometheus":
            continue
        per_event: collections.Counter[str] = collections.Counter()
        for line in proc.log.read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                problems.append(f"{proc.name}: not a JSON log line: {line[:200]}")
                continue
            per_event[str(record.get("event"))] += 1
            seen_session |= record.get("session_id") == session_id
            seen_job |= record.get("job_id") == job_id
        # one stream of ~40 frames must not produce ~40 lines of one event
        for event, count in per_event.items():
            if count >= 20:
                problems.append(f"{proc.name}: {count} '{event}' lines at the default level")
    assert seen_session, "no log event carries the stream's session_id"
    assert seen_job, "no log event carries the job's job_id"
    assert not problems, "\n".join(problems)


async def test_cluster_gauges_follow_the_job_stream(redis_server: RedisServer) -> None:
    """Queue depth = undelivered + pending entries of the consumer group; the oldest age
    comes from the oldest such entry's id; finished entries (XACK + XDEL) leave both."""
    import redis.asyncio as aioredis

    from gateway import health
    from lanegate import metrics
    from lanegate.constants import JOB_GROUP, JOB_STREAM

    def entry_ms(entry: bytes | str) -> int:
        text = entry.decode() if isinstance(entry, bytes) else entry
        return int(text.split("-")[0])

    def gauge(metric: Any) -> float:
        value: float = metric.labels(lane="batch")._value.get()
        return value

    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await health.refresh_cluster_gauges(client)  # no stream yet
        assert gauge(metrics.QUEUE_DEPTH) == 0
        assert gauge(metrics.QUEUE_OLDEST_AGE) == 0

        await client.xgroup_create(JOB_STREAM, JOB_GROUP, id="0", mkstream=True)
        ids = [await client.xadd(JOB_STREAM, {"job_id": f"j{i}"}) for i in range(3)]
        first_ms = entry_ms(ids[0])
        await client.xreadgroup(JOB_GROUP, "w1", {JOB_STREAM: ">"}, count=1)

        await health.refresh_cluster_gauges(client, now=first_ms / 1000 + 42.0)
        assert gauge(metrics.QUEUE_DEPTH) == 3
        assert gauge(metrics.QUEUE_OLDEST_AGE) == pytest.approx(42.0)

        # the delivered job finishes: acknowledged and deleted, as lanes/queue.py does
        await client.xack(JOB_STREAM, JOB_GROUP, ids[0])
        await client.xdel(JOB_STREAM, ids[0])
        second_ms = entry_ms(ids[1])
        await health.refresh_cluster_gauges(client, now=second_ms / 1000 + 5.0)
        assert gauge(metrics.QUEUE_DEPTH) == 2
        assert gauge(metrics.QUEUE_OLDEST_AGE) == pytest.approx(5.0)

        for entry in ids[1:]:
            await client.xdel(JOB_STREAM, entry)
        await health.refresh_cluster_gauges(client)
        assert gauge(metrics.QUEUE_DEPTH) == 0
        assert gauge(metrics.QUEUE_OLDEST_AGE) == 0
    finally:
        await client.aclose()
