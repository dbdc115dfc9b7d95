"""The soak: live sessions opening and closing at a steady rate for an hour, batch uploads
beside them, and the resident memory (and open descriptors) of every process sampled.
Memory must stay flat after the warm-up: the median RSS of the last window at most
``limit`` above the median of the first window after the warm-up, for every process.

    python -m bench soak --duration-s 3600 --out bench/results/soak

The stack is ``lanegate up``'s processes (redis-server, gateway, a realtime worker, a
batch worker) on the simulated engine by default (``--engine`` for another): what a
session leaves behind in the gateway, the link and the worker is the same whatever
engine decodes it, and the simulated one leaves the CPUs to the sampling. The load is
one ``bench.load`` process. Writes ``soak.json``, ``soak_rss.png`` and the soak section
of BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import audio, measure
from bench.load import StreamSpec
from bench.measure import stream_url
from bench.run import COMMON_ENV
from bench.sections import SOAK
from bench.stack import Stack, StackPlan, WorkerPlan
from bench.stats import summary

BEGIN, END = SOAK.begin, SOAK.end


@dataclass
class SoakOptions:
    out: Path = Path("bench/results/soak")
    workdir: Path = Path("bench/.work")
    engine: str = "simulated"
    duration_s: float = 3600.0  # sessions are opened for this long
    warmup_s: float = 600.0  # memory before this is not judged (caches, allocator arenas)
    judge_window_s: float = 300.0  # the first window after the warm-up against the last
    every_s: float = 0.5  # a new live session this often
    session_s: float = 8.0  # seconds of audio each session streams at real-time pace
    upload_every_s: float = 30.0  # an async upload this often
    upload_s: float = 20.0  # seconds of audio per upload
    sample_every_s: float = 10.0
    limit: float = 0.10  # allowed RSS growth after the warm-up
    rt_cpus: str = "0"
    batch_cpus: str = "1"

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


@dataclass
class Sample:
    t_s: float  # seconds since the load started
    rss_kib: dict[str, int] = field(default_factory=dict)
    fds: dict[str, int] = field(default_factory=dict)


def soak_plan(o: SoakOptions) -> StackPlan:
    slots = int(o.session_s / o.every_s * 2) + 16  # twice the sessions open at a time
    env = {**COMMON_ENV, "LANEGATE_ENGINE": o.engine, "LANEGATE_LANES": "split",
           "LANEGATE_SLOTS": str(slots)}
    return StackPlan("soak", env, [WorkerPlan("realtime", o.rt_cpus),
                                   WorkerPlan("batch", o.batch_cpus)], o.rt_cpus, o.rt_cpus)


def read_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"no VmRSS for pid {pid}")


def sample(stack: Stack, t_s: float) -> Sample:
    out = Sample(round(t_s, 1))
    for child in stack.children:
        if child.proc is None:
            continue
        with contextlib.suppress(OSError, ValueError):
            out.rss_kib[child.name] = read_rss_kib(child.proc.pid)
            out.fds[child.name] = sum(1 for _ in Path(f"/proc/{child.proc.pid}/fd").iterdir())
    return out


def judge(samples: list[Sample], *, warmup_s: float, window_s: float,
          limit: float) -> dict[str, Any]:
    """Per process: median RSS of the first window after the warm-up and of the last
    window, the growth between them, and ``met`` when no process grew more than ``limit``."""
    if not samples:
        return {"verdict": "missed", "reason": "no samples", "processes": {}}
    end_t = samples[-1].t_s
    first = [s for s in samples if warmup_s <= s.t_s < warmup_s + window_s]
    last = [s for s in samples if s.t_s > end_t - window_s]
    if not first or first[-1].t_s >= last[0].t_s:
        return {"verdict": "missed", "processes": {},
                "reason": "the run is too short for its warm-up and windows"}
    processes: dict[str, Any] = {}
    for name in samples[0].rss_kib:
        before = statistics.median(s.rss_kib[name] for s in first if name in s.rss_kib)
        after = statistics.median(s.rss_kib[name] for s in last if name in s.rss_kib)
        fds = [s.fds[name] for s in samples if name in s.fds]
        processes[name] = {
            "rss_mib_after_warmup": round(before / 1024, 1),
            "rss_mib_at_end": round(after / 1024, 1),
            "growth": round(after / before - 1, 4),
            "rss_mib_max": round(max(s.rss_kib.get(name, 0) for s in samples) / 1024, 1),
            "fds_after_warmup": fds[len(fds) // 10] if fds else None,
            "fds_at_end": fds[-1] if fds else None,
        }
    worst = max(p["growth"] for p in processes.values())
    return {"verdict": "met" if worst <= limit else "missed", "limit": limit,
            "worst_growth": worst, "processes": processes}


def latency_by_window(results: list[dict[str, Any]], window_s: float) -> list[dict[str, Any]]:
    """Partial latency p50/p99 per ``window_s`` of the run: a slowing service shows here
    before it shows in memory."""
    bins: dict[int, list[float]] = {}
    for r in results:
        for at, ms in zip(r["partial_at_s"], r["partial_ms"], strict=True):
            bins.setdefault(int(at // window_s), []).append(ms)
    out = []
    for k, v in sorted(bins.items()):
        s = summary(v)
        out.append({"from_s": k * window_s, "partials": len(v), "p50_ms": s["p50"],
                    "p99_ms": s["p99"]})
    return out


async def run_load_process(specs: list[StreamSpec], work: Path, timeout_s: float,
                           started: asyncio.Event) -> list[dict[str, Any]]:
    """One load process for every session (they are few at a time)."""
    spec_path, out_path = work / "soak-load.json", work / "soak-load.out.json"
    spec_path.write_text(json.dumps({"t0_wall": time.time() + 2.0,
                                     "streams": [asdict(s) for s in specs]}))
    out_path.unlink(missing_ok=True)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.load",
                                                str(spec_path), str(out_path))
    await asyncio.sleep(2.0)
    started.set()
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if not out_path.exists():
        raise RuntimeError("the soak's load process wrote nothing (it crashed)")
    results: list[dict[str, Any]] = json.loads(out_path.read_text())["results"]
    return results


class Soak:
    def __init__(self, o: SoakOptions) -> None:
        self.o = o
        self.work = o.workdir / "soak"
        self.samples: list[Sample] = []
        self.job_ids: list[str] = []
        self.upload_errors: list[str] = []

    def specs(self, url: str, pcm: Path) -> list[StreamSpec]:
        n = int(self.o.duration_s / self.o.every_s)
        return [StreamSpec(kind="live", url=url, pcm_path=str(pcm), start_s=i * self.o.every_s,
                           duration_s=self.o.session_s, pcm_offset_s=7.3 * i)
                for i in range(n)]

    async def sampler(self, stack: Stack, t0: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.samples.append(sample(stack, time.monotonic() - t0))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.o.sample_every_s)

    async def uploader(self, stack: Stack, upload: Path, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                self.job_ids += await measure.submit(stack, [upload])
            except (OSError, RuntimeError, aiohttp.ClientError) as exc:
                self.upload_errors.append(f"{type(exc).__name__}: {exc}"[:200])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.o.upload_every_s)

    async def run(self) -> dict[str, Any]:
        self.work.mkdir(parents=True, exist_ok=True)
        live = self.work / "live.pcm"
        if not live.exists():
            live.write_bytes(audio.speech(180, self.o.workdir, seed=1))
        upload = audio.upload_file(self.o.upload_s, self.o.workdir, 3)
        async with Stack(soak_plan(self.o), self.work) as stack:
            started, stop = asyncio.Event(), asyncio.Event()
            load = asyncio.create_task(run_load_process(
                self.specs(stream_url(stack.url), live), self.work,
                self.o.duration_s + 300, started))
            await started.wait()
            t0 = time.monotonic()
            tasks = [asyncio.create_task(self.sampler(stack, t0, stop)),
                     asyncio.create_task(self.uploader(stack, upload, stop))]
            try:
                results = await load
            finally:
                stop.set()
                await asyncio.gather(*tasks, return_exceptions=True)
            jobs = await measure.wait_jobs(stack, self.job_ids, timeout_s=300)
            self.samples.append(sample(stack, time.monotonic() - t0))
            alive = [c.name for c in stack.children if c.running]
        return self.summarize(results, jobs, alive)

    def summarize(self, results: list[dict[str, Any]], jobs: list[dict[str, Any]],
                  alive: list[str]) -> dict[str, Any]:
        o = self.o
        memory = judge(self.samples, warmup_s=o.warmup_s, window_s=o.judge_window_s,
                       limit=o.limit)
        errors: dict[str, int] = {}
        for r in results:
            if r["error"]:
                errors[r["error"]] = errors.get(r["error"], 0) + 1
        statuses: dict[str, int] = {}
        for j in jobs:
            statuses[j["status"]] = statuses.get(j["status"], 0) + 1
        return {"options": o.to_json(), "memory": memory,
                "sessions": len(results), "session_errors": errors,
                "finals": sum(len(r["final_ms"]) for r in results),
                "latency": latency_by_window(results, o.judge_window_s),
                "uploads": statuses, "upload_errors": self.upload_errors,
                "processes_alive_at_end": alive,
                "samples": [asdict(s) for s in self.samples]}


# --- report --------------------------------------------------------------------------

def section(doc: dict[str, Any]) -> str:
    o, m = doc["options"], doc["memory"]
    failed_uploads = len(doc["upload_errors"])
    out = [BEGIN, "## Soak: an hour of sessions, memory sampled", "",
           f"`python -m bench soak --duration-s {o['duration_s']:g}` ({doc.get('when', '')}): "
           f"a live session opened every {o['every_s']:g} s, each streaming "
           f"{o['session_s']:g} s at real-time pace ({doc['sessions']} sessions, "
           f"{doc['finals']} finals), and a {o['upload_s']:g} s upload every "
           f"{o['upload_every_s']:g} s; engine `{o['engine']}`. RSS and open descriptors of "
           f"every process every {o['sample_every_s']:g} s. Judged: the median RSS of the "
           f"last {o['judge_window_s']:g} s against that of the first {o['judge_window_s']:g} s "
           f"after a {o['warmup_s']:g} s warm-up, at most +{100 * o['limit']:.0f} %.", "",
           f"**Verdict: {m['verdict']}** (worst growth {100 * m.get('worst_growth', 0):+.1f} %). "
           f"Session errors: {doc['session_errors'] or 'none'}; uploads: {doc['uploads']}"
           f"{f'; refused uploads: {failed_uploads}' if failed_uploads else ''}; "
           f"processes alive at the end: {', '.join(doc['processes_alive_at_end'])}.", "",
           "| process | RSS after warm-up (MiB) | RSS at end (MiB) | growth | max (MiB) "
           "| fds after warm-up | fds at end |", "|---|---|---|---|---|---|---|"]
    for name, p in m["processes"].items():
        out.append(f"| {name} | {p['rss_mib_after_warmup']} | {p['rss_mib_at_end']} | "
                   f"{100 * p['growth']:+.1f} % | {p['rss_mib_max']} | "
                   f"{p['fds_after_warmup']} | {p['fds_at_end']} |")
    out += ["", "Partial latency per window (a slowing service shows here first):", "",
            "| from (s) | partials | p50 (ms) | p99 (ms) |", "|---|---|---|---|"]
    out += [f"| {w['from_s']:g} | {w['partials']} | {w['p50_ms']} | {w['p99_ms']} |"
            for w in doc["latency"]]
    out += ["", "![RSS over the soak](bench/results/soak/soak_rss.png)", END]
    return "\n".join(out) + "\n"


def write_section(doc: dict[str, Any], markdown_path: Path) -> None:
    SOAK.put(section(doc), markdown_path)


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    samples = doc["samples"]
    for name in samples[0]["rss_kib"] if samples else []:
        points = [(s["t_s"] / 60, s["rss_kib"][name] / 1024) for s in samples
                  if name in s["rss_kib"]]
        ax.plot([p[0] for p in points], [p[1] for p in points], label=name)
    ax.axvline(doc["options"]["warmup_s"] / 60, color="grey", linestyle=":", label="warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MiB)")
    ax.set_yscale("log")
    ax.legend(fontsize="small")
    ax.set_title("Soak: resident memory of every process")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(o: SoakOptions, markdown: Path) -> dict[str, Any]:
    o.out.mkdir(parents=True, exist_ok=True)
    doc = asyncio.run(Soak(o).run())
    doc["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (o.out / "soak.json").write_text(json.dumps(doc, indent=1))
    plot(doc, o.out / "soak_rss.png")
    write_section(doc, markdown)
    return doc
