"""Measurement windows against a running stack: load processes, metrics scrapes, batch jobs."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from itertools import pairwise
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.load import StreamSpec
from bench.machine import PerfCounter, proc_stat
from bench.stack import Stack, cpu_list, pin
from bench.stats import Histogram, merge, parse_histograms, summary

STREAMS_PER_LOAD_PROCESS = 128
#: the steady part of a window (every live stream sending) starts this long after the
#: last stream's start (its connect and admission done) and ends this long before the
#: first stream's end (before its ``end``, last finals and close)
STEADY_AFTER_START_S = 1.0
STEADY_BEFORE_END_S = 0.5
#: the least steady part worth a figure
STEADY_MIN_S = 2.0


def live_specs(url: str, n: int, duration_s: float, pcm_path: Path, *,
               ramp_s: float = 2.0) -> list[StreamSpec]:
    """``n`` real-time streams, connecting over ``ramp_s``, each saying different things."""
    return [StreamSpec(kind="live", url=url, pcm_path=str(pcm_path),
                       start_s=ramp_s * i / max(n, 1), duration_s=duration_s,
                       pcm_offset_s=7.3 * i)
            for i in range(n)]


def dump_spec(url: str, pcm_path: Path, *, dump_s: float, every_s: float, first_s: float,
              duration_s: float) -> StreamSpec:
    """One dumper session, opened first (before the live streams): dumps from ``first_s``."""
    return StreamSpec(kind="dump", url=url, pcm_path=str(pcm_path), start_s=0.0,
                      duration_s=duration_s, dump_s=dump_s, dump_every_s=every_s,
                      first_dump_s=first_s)


def stream_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/v1/stream?sample_rate=16000&language=en"


def worker_session_url(worker_url: str) -> str:
    return (worker_url.replace("http://", "ws://")
            + "/internal/v1/session?session_id={session_id}&sample_rate=16000&language=en")


async def run_load(specs: list[StreamSpec], workdir: Path, name: str,
                   timeout_s: float, *, on_start: Callable[[float], None] | None = None,
                   cpus: str = "") -> tuple[list[dict[str, Any]], float]:
    """Spread ``specs`` over load processes, start them together, collect their results.
    ``on_start`` gets the wall-clock time the streams' ``start_s`` count from; ``cpus``
    pins the load processes (``taskset`` list; "" = not pinned)."""
    nproc = max(1, math.ceil(len(specs) / STREAMS_PER_LOAD_PROCESS))
    t0_wall = time.time() + 1.5 + 0.2 * nproc
    if on_start is not None:
        on_start(t0_wall)
    procs = []
    outs = []
    for k in range(nproc):
        spec_path = workdir / f"{name}-load{k}.json"
        out_path = workdir / f"{name}-load{k}.out.json"
        spec_path.write_text(json.dumps({"t0_wall": t0_wall,
                                         "streams": [asdict(s) for s in specs[k::nproc]]}))
        out_path.unlink(missing_ok=True)  # a load process that dies must not leave an old one
        procs.append(await asyncio.create_subprocess_exec(
            *pin(cpus), sys.executable, "-m", "bench.load", str(spec_path), str(out_path)))
        outs.append(out_path)
    try:
        await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), timeout_s)
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
    results: list[dict[str, Any]] = []
    cpu = 0.0
    for out in outs:
        if not out.exists():
            raise RuntimeError(f"load process for {out.name} wrote nothing (it crashed)")
        doc = json.loads(out.read_text())
        if cpus and doc.get("cpus") != cpu_list(cpus):
            raise RuntimeError(f"load process for {out.name} ran on CPUs {doc.get('cpus')}, "
                               f"not the planned {cpus}")
        results += doc["results"]
        cpu += doc["cpu_s"]
    return results, cpu


async def scrape(stack: Stack) -> dict[str, dict[str, Histogram]]:
    """Step-duration histograms of every live worker with a URL, by worker id and lane."""
    out: dict[str, dict[str, Histogram]] = {}
    workers = await stack.realtime_workers() + await stack.batch_workers()
    async with aiohttp.ClientSession() as http:
        for w in workers:
            if not w.url:
                continue
            try:
                async with http.get(w.url + "/metrics",
                                    timeout=aiohttp.ClientTimeout(5)) as r:
                    out[w.worker_id] = parse_histograms(await r.text())
            except (aiohttp.ClientError, TimeoutError):
                continue
    return out


def step_delta(before: dict[str, dict[str, Histogram]],
               after: dict[str, dict[str, Histogram]]) -> dict[str, Any]:
    """Per-lane step histograms of the window (after minus before, summed over workers)."""
    lanes: dict[str, list[Histogram]] = {}
    for worker, hists in after.items():
        for lane, hist in hists.items():
            earlier = before.get(worker, {}).get(lane, Histogram({}, 0.0))
            lanes.setdefault(lane, []).append(hist.minus(earlier))
    return {lane: merge(hs).to_json() for lane, hs in lanes.items()}


#: percentiles stored for the CDF plots: every 1 %, denser in the tail
CDF_PERCENTILES = sorted({*range(0, 100), *np.arange(99.0, 100.0, 0.1).round(1).tolist(),
                          *np.arange(99.9, 100.0, 0.01).round(2).tolist(), 100.0})


def cpu_times() -> dict[str, list[int]]:
    """Per-CPU jiffies from /proc/stat: user nice system idle iowait irq softirq steal."""
    return {k: v for k, v in proc_stat().items() if k != "cpu"}


def cpu_usage(before: dict[str, list[int]], after: dict[str, list[int]]) -> dict[str, Any]:
    """Share of each CPU that was busy, and stolen by the hypervisor, between two reads."""
    out: dict[str, Any] = {}
    for cpu, now in after.items():
        d = [a - b for a, b in zip(now, before.get(cpu, now), strict=True)]
        total = sum(d) or 1
        idle = d[3] + d[4]
        out[cpu] = {"busy": round((total - idle) / total, 3), "steal": round(d[7] / total, 3)}
    return out


def cdf(samples: list[float]) -> list[list[float]]:
    """[percentile, latency ms] pairs."""
    if not samples:
        return []
    values = np.percentile(np.asarray(samples), CDF_PERCENTILES)
    return [[float(q), round(float(v), 2)] for q, v in zip(CDF_PERCENTILES, values, strict=True)]


def timeline(results: list[dict[str, Any]], bin_s: float = 0.5,
             stalls: tuple[float, float] | None = None) -> list[list[float]]:
    """Worst partial latency of the live streams in each ``bin_s`` of the window;
    ``stalls`` (seconds after t0, ms): a stalled stream's latency where the window ends."""
    worst: dict[int, float] = {}
    if stalls is not None:
        worst[int(stalls[0] / bin_s)] = stalls[1]
    for r in results:
        if r["kind"] != "live":
            continue
        for at, ms in zip(r["partial_at_s"], r["partial_ms"], strict=True):
            b = int(at / bin_s)
            worst[b] = max(worst.get(b, 0.0), ms)
    return [[round(b * bin_s, 2), round(v, 1)] for b, v in sorted(worst.items())]


def steady_window(specs: list[StreamSpec]) -> tuple[float, float]:
    """From the last live stream's start to the first live stream's end: all are on."""
    live = [s for s in specs if s.kind == "live"]
    if not live:
        return (0.0, math.inf)
    return (max(s.start_s for s in live), min(s.start_s + s.duration_s for s in live))


def measured_span(specs: list[StreamSpec]) -> tuple[float, float]:
    """The part of ``steady_window`` a server's cost is measured over: within its
    margins, clear of the last connect and the first goodbye."""
    start, end = steady_window(specs)
    return (start + STEADY_AFTER_START_S, end - STEADY_BEFORE_END_S)


def messages(results: list[dict[str, Any]]) -> dict[str, Any]:
    """WebSocket messages the clients sent and received, in all and per stream-second
    (a second of one live stream's audio): the gateway forwards each of them."""
    stream_s = sum(r["audio_s_sent"] for r in results if r["kind"] == "live")
    sent = sum(int(r.get("frames_sent", 0)) for r in results)
    received = sum(int(r.get("events_received", 0)) for r in results)

    def per(n: int) -> float | None:
        return round(n / stream_s, 3) if stream_s > 0 else None

    return {"sent": sent, "received": received, "stream_s": round(stream_s, 1),
            "sent_per_stream_s": per(sent), "received_per_stream_s": per(received)}


def stalled(results: list[dict[str, Any]], steady: tuple[float, float]) -> list[int]:
    """The live streams that were served (admitted to a lane) but got no partial while
    every live stream was on: stalled, not missing (indices into ``results``)."""
    lo, hi = steady
    if not math.isfinite(hi) or hi <= lo:
        return []
    return [i for i, r in enumerate(results) if r["kind"] == "live" and r["lane"]
            and not any(lo <= at <= hi for at in r["partial_at_s"])]


def longest_waits(results: list[dict[str, Any]], steady: tuple[float, float]) -> list[float]:
    """Each served live stream's longest wait for a partial while every stream was on
    (ms): the longest span of ``steady`` with no partial arriving, its ends included.
    (A stream's own pauses are in it too; a design that starves a stream shows here
    even when the few partials it sends are quick.)"""
    lo, hi = steady
    if not math.isfinite(hi) or hi <= lo:
        return []
    out = []
    for r in results:
        if r["kind"] != "live" or not r["lane"]:
            continue
        marks = [lo, *sorted(at for at in r["partial_at_s"] if lo <= at <= hi), hi]
        out.append(round(1000 * max(b - a for a, b in pairwise(marks)),
                         1))
    return out


def summarize(results: list[dict[str, Any]],
              steady: tuple[float, float] = (0.0, math.inf)) -> dict[str, Any]:
    """Figures of a window; partial latency counts only partials that arrived while
    every live stream was on (``steady``, seconds after t0), ``partial_all_ms`` all.
    A stream that got no partial in that span stalled: its latency is the span's
    length, its worst figure, counted in ``partial_ms`` (and its CDF) like any partial,
    and the count is ``stalled_streams`` (a stall is not a missing figure)."""
    live = [r for r in results if r["kind"] == "live"]
    dumps = [r for r in results if r["kind"] == "dump"]
    lo, hi = steady
    partial = [v for r in live for at, v in zip(r["partial_at_s"], r["partial_ms"], strict=True)
               if lo <= at <= hi]
    stalls = stalled(results, steady)
    stall_ms = round((hi - lo) * 1000, 1) if stalls else None
    partial += [stall_ms] * len(stalls) if stall_ms is not None else []
    out: dict[str, Any] = {
        "live_streams": len(live),
        "steady_window_s": [round(lo, 2), round(hi, 2)],
        "streams_served": sum(1 for r in live if r["lane"]),
        "partial_all_ms": summary([v for r in live for v in r["partial_ms"]]),
        "lanes_seen": sorted({r["lane"] for r in results if r["lane"]}),
        "errors": dict(Counter(r["error"] for r in results if r["error"])),
        "audio_s_sent": round(sum(r["audio_s_sent"] for r in live), 1),
        "partial_ms": summary(partial),
        "stalled_streams": len(stalls),
        "longest_wait_ms": summary(longest_waits(results, steady)),
        "stall_ms": stall_ms,
        "first_partial_ms": summary([v for r in live for v in r["first_partial_ms"]]),
        "final_ms": summary([v for r in live for v in r["final_ms"]]),
        "final_words": sum(r["final_words"] for r in live),
        "finals_without_audio_end": sum(r["finals_without_audio_end"] for r in live),
        "partial_cdf_ms": cdf(partial),
        "timeline_worst_ms": timeline(results, stalls=None if stall_ms is None
                                      else (hi, stall_ms)),
        "messages": messages(results),
    }
    if dumps:
        out["dump"] = {"dumps_digested": sum(len(r["dump_done_s"]) for r in dumps),
                       "digest_s": [round(v, 2) for r in dumps for v in r["dump_done_s"]],
                       "partial_ms": summary([v for r in dumps for v in r["partial_ms"]])}
    return out


class SteadyCpu:
    """The CPU of the child ``server`` (the gateway unless told) over the steady part of
    a window (``steady_window``, within its margins), sampled from /proc at its two ends
    while the load runs."""

    def __init__(self, stack: Stack, specs: list[StreamSpec], server: str = "gateway") -> None:
        self._stack = stack
        self._server = server
        self._span = measured_span(specs)
        self.streams = sum(1 for s in specs if s.kind == "live")
        self.samples: list[tuple[float, float]] = []  # (monotonic time, gateway CPU s)
        self._task: asyncio.Task[None] | None = None

    def start(self, t0_wall: float) -> None:
        if self.streams and self._span[1] - self._span[0] >= STEADY_MIN_S:
            self._task = asyncio.create_task(self._sample(t0_wall))

    async def _sample(self, t0_wall: float) -> None:
        for offset in self._span:
            await asyncio.sleep(max(0.0, t0_wall + offset - time.time()))
            cpu = self._stack.cpu_seconds().get(self._server)
            if cpu is None:
                return
            self.samples.append((time.monotonic(), cpu))

    def result(self) -> dict[str, Any] | None:
        """CPU s, wall s and stream-seconds of the steady part; None without one."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if len(self.samples) < 2:
            return None
        (t_a, cpu_a), (t_b, cpu_b) = self.samples
        stream_s = self.streams * (t_b - t_a)
        return {"cpu_s": round(cpu_b - cpu_a, 3), "wall_s": round(t_b - t_a, 2),
                "stream_s": round(stream_s, 1), "streams": self.streams,
                "cpu_s_per_stream_s": (cpu_b - cpu_a) / stream_s if stream_s > 0 else None}


async def window(stack: Stack, name: str, specs: list[StreamSpec], workdir: Path,
                 duration_s: float, *, count_instructions: bool = False,
                 server: str = "gateway") -> dict[str, Any]:
    """One measured window: scrape, load, scrape; client and server figures together.
    ``count_instructions``: the gateway's instructions over the window (``perf stat``).
    ``server``: the child the load talks to, whose CPU the ``gateway_*`` figures are
    (``floor``: ``bench.floor``'s bare server)."""
    before = await scrape(stack)
    perf = PerfCounter(stack.pid(server)) if count_instructions else None
    cpu0, wait0, t0 = stack.cpu_seconds(), stack.runqueue_wait_seconds(), time.monotonic()
    machine0 = cpu_times()
    steady = SteadyCpu(stack, specs, server)
    results, load_cpu = await run_load(specs, workdir, name, timeout_s=duration_s + 180,
                                       on_start=steady.start, cpus=stack.plan.load_cpus)
    cpu1, wait1, t1 = stack.cpu_seconds(), stack.runqueue_wait_seconds(), time.monotonic()
    instructions = perf.stop() if perf is not None else None
    machine = cpu_usage(machine0, cpu_times())
    after = await scrape(stack)
    stack.check_alive()
    out = summarize(results, steady_window(specs))
    out["steps"] = step_delta(before, after)
    out["cpu_s"] = {name: round(cpu1[name] - cpu0[name], 3) for name in cpu1 if name in cpu0}
    out["cpu_s"]["load_clients"] = round(load_cpu, 3)
    out["runqueue_wait_s"] = {name: round(wait1[name] - wait0[name], 3)
                              for name in wait1 if name in wait0}
    out["load_avg_after"] = list(os.getloadavg())
    out["machine_cpu"] = machine
    out["gateway_cpu_s"] = out["cpu_s"].get(server)
    out["gateway_steady"] = steady.result()
    if count_instructions:
        out["gateway_instructions"] = instructions
    out["wall_s"] = round(t1 - t0, 2)
    print(f"  [{stack.plan.design}/{name}] partial {out['partial_ms']} errors {out['errors']}",
          flush=True)
    return out


# --- batch jobs -----------------------------------------------------------------


async def submit(stack: Stack, files: list[Path]) -> list[str]:
    ids = []
    async with aiohttp.ClientSession() as http:
        for path in files:
            form = aiohttp.FormData()
            form.add_field("async", "true")
            form.add_field("file", path.read_bytes(), filename=path.name,
                           content_type="audio/wav")
            async with http.post(stack.url + "/v1/transcriptions", data=form) as r:
                body = await r.json()
                if r.status != 202:
                    raise RuntimeError(f"upload refused: {r.status} {body}")
                ids.append(str(body["id"]))
    return ids


async def jobs(stack: Stack, ids: list[str]) -> list[dict[str, Any]]:
    out = []
    async with aiohttp.ClientSession() as http:
        for job_id in ids:
            async with http.get(f"{stack.url}/v1/transcriptions/{job_id}") as r:
                out.append(await r.json())
    return out


async def job_texts(stack: Stack, ids: list[str]) -> list[str]:
    """Each completed job's transcript as plain text ("" for one that is not)."""
    out = []
    async with aiohttp.ClientSession() as http:
        for job_id in ids:
            async with http.get(f"{stack.url}/v1/transcriptions/{job_id}",
                                params={"format": "text"}) as r:
                out.append(await r.text() if r.status == 200 else "")
    return out


#: the job statuses that end a job
TERMINAL = ("completed", "failed", "cancelled")


async def poll_jobs(stack: Stack, ids: list[str], timeout_s: float,
                    until: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
    """The jobs' state every 0.5 s until ``until`` holds of it or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = await jobs(stack, ids)
        if until(state) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.5)


async def wait_jobs(stack: Stack, ids: list[str], timeout_s: float) -> list[dict[str, Any]]:
    return await poll_jobs(stack, ids, timeout_s,
                           lambda state: all(j["status"] in TERMINAL for j in state))


async def wait_first(stack: Stack, ids: list[str], timeout_s: float) -> dict[str, Any] | None:
    """The first of ``ids`` to complete (the earliest ``finished_at``), waiting for one;
    None when none completes in ``timeout_s`` or all end otherwise."""
    state = await poll_jobs(stack, ids, timeout_s, lambda state: any(
        j["status"] == "completed" for j in state) or all(j["status"] in TERMINAL
                                                          for j in state))
    done = [j for j in state if j["status"] == "completed"]
    return min(done, key=lambda j: float(j["finished_at"])) if done else None


def throughput(state: list[dict[str, Any]], now: float | None = None) -> dict[str, Any]:
    """Audio seconds transcribed per wall second: completed jobs over their span, or,
    when ``now`` is given, audio done so far (progress) over the time since the first start.

    With ``now``, a flood that every job of had finished before ``now`` ran dry: the lane
    idled for the rest of the time, so its rate is taken to the last finish, and
    ``ran_dry_s`` says how long before ``now`` that was (the live streams beside it were
    not under the flood for those seconds). Otherwise the progress a job reports moves
    one batch at a time (Whisper: up to ``batch_max_audio_s``, 200 s, about 9 s of
    work), so the audio done is counted as of the last progress write or finish
    (``last_progress``) and the rate taken to then; ``progress_age_s`` says how long
    before ``now`` that was. Taken to ``now`` instead, the same lane read 18.2 or 21.2
    audio s per wall s over a 60 s window as a batch had just been written or not."""
    started = [j["started_at"] for j in state if j.get("started_at")]
    if not started:
        return {"jobs": len(state), "completed": 0, "audio_s_per_wall_s": None}
    done = [j for j in state if j["status"] == "completed"]
    last = max((j["finished_at"] for j in done), default=min(started))
    dry: dict[str, float] = {}
    if now is None:
        audio = sum(float(j["audio_seconds"]) for j in done)
        end = last
    else:
        audio = sum(float(j["audio_seconds"]) * float(j["progress"]) for j in state)
        end = now
        mark = last_progress(state)
        if len(done) == len(state) and last < now:
            end, dry = last, {"ran_dry_s": round(now - last, 2)}
        elif mark is not None and min(started) < mark < now:
            end, dry = mark, {"progress_age_s": round(now - mark, 2)}
    span = end - min(started)
    return {"jobs": len(state), "completed": len(done), "audio_s": round(audio, 2),
            "span_s": round(span, 2),
            "audio_s_per_wall_s": round(audio / span, 3) if span > 0 else None,
            "statuses": dict(Counter(j["status"] for j in state)), **dry}


def last_progress(state: list[dict[str, Any]]) -> float | None:
    """When the audio counted as done (progress x audio) was last brought up to date:
    the latest finish or progress write, a batch's end; None when a running job with
    progress has no ``updated_at`` (its write time unknown)."""
    marks = []
    for j in state:
        if j["status"] == "completed" and j.get("finished_at"):
            marks.append(float(j["finished_at"]))
        elif j["status"] == "processing" and j.get("progress"):
            if not j.get("updated_at"):
                return None
            marks.append(float(j["updated_at"]))
    return max(marks, default=None)
