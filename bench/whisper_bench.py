"""The Whisper benchmark: accuracy table, realtime lane with Whisper base, and the peer.

``python -m bench whisper --parts all --out bench/results/whisper`` runs every part and
writes ``whisper.json`` there and a section into BENCHMARKS.md (between markers).
Parts: ``accuracy`` (WER of each engine alone and through the service), ``realtime``
(two live streams alone, beside a batch flood in ``split`` and in ``mixed``, in
``rounds``), ``capacity`` (streams stepped up until partial p99 passes the limit),
``dump`` (step durations with and without the cap while a client dumps 20 s) and
``peer`` (WhisperLive and lanegate side by side on the same streams and uploads).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import accuracy, audio, corpus, peer
from bench.load import StreamSpec
from bench.machine import Moment
from bench.measure import (
    STREAMS_PER_LOAD_PROCESS,
    dump_spec,
    jobs,
    stream_url,
    submit,
    throughput,
    window,
)
from bench.run import COMMON_ENV
from bench.stack import Stack, StackPlan, WorkerPlan
from bench.verdict import WHISPER_CPU_P99_MS
from bench.wer import corpus_wer
from engines import models

PARTS = ("accuracy", "realtime", "capacity", "dump", "peer")
#: partial latency p99 a live stream must keep (ms); the capacity's limit too
PARTIAL_P99_MS = WHISPER_CPU_P99_MS


#: final latency p99 a live stream must keep (ms): a step count of streams held needs both
FINAL_P99_MS = 2000.0


def held(step: dict[str, Any]) -> bool:
    """A step of the capacity part holds its streams: partial p99 and final p99 within
    their limits and no stream refused or broken. (Partial p99 alone is not enough: a
    re-decoding engine under load sends fewer partials, and the few it sends can be
    quick while finals lag.)"""
    p99, f99 = step["partial_ms"]["p99"], step["final_ms"]["p99"]
    return (p99 is not None and p99 <= PARTIAL_P99_MS and f99 is not None
            and f99 <= FINAL_P99_MS and not step["errors"])


@dataclass
class WhisperOptions:
    out: Path = Path("bench/results/whisper")
    workdir: Path = Path("bench/.work/whisper")
    parts: tuple[str, ...] = PARTS
    models: tuple[str, ...] = ("base",)  # Whisper models of the accuracy table
    per_condition: int = 8  # sentences per voice/rate/noise condition
    stream_pace: float = 2.0  # accuracy streams: x real time
    live_s: float = 40.0  # seconds of speech per live stream
    streams: int = 2  # live streams of the realtime part and the peer
    flood_jobs: int = 2
    flood_job_s: float = 300.0  # 2 x 300 s outlast a 40 s window (the batch lane: ~8x)
    rounds: int = 1
    capacity_max: int = 5
    capacity_s: float = 30.0
    dump_s: float = 20.0
    peer_venv: Path = Path("/work/wlvenv")
    peer_tail_s: float = 15.0
    rt_cpus: str = "0"
    batch_cpus: str = "1"
    env: dict[str, str] = field(default_factory=dict)  # LANEGATE_* over the defaults

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


def model_dir(spec: str) -> str | None:
    """The CTranslate2 directory of a bundled name or path; None if it is not usable."""
    try:
        return str(models.resolve(spec, os.path.expanduser("~/.lanegate")))
    except models.ModelError as exc:
        print(f"model {spec}: {exc}", flush=True)
        return None


def whisper_plan(design: str, o: WhisperOptions, model: str) -> StackPlan:
    """Whisper in both lanes, pinned as ``bench.run``'s stacks are: realtime worker,
    gateway and redis-server on the realtime CPUs, the batch worker alone on the batch
    CPUs; ``mixed``: a mixed worker in each of those places, the same hardware.
    ``split-nocap``: the realtime lane without the step budget's cap."""
    env = {**COMMON_ENV, "LANEGATE_ENGINE": "whisper", "LANEGATE_WHISPER_MODEL": model,
           **o.env}
    if design == "mixed":
        return StackPlan(design, {**env, "LANEGATE_LANES": "mixed"},
                         [WorkerPlan("mixed", o.rt_cpus), WorkerPlan("mixed", o.batch_cpus)],
                         o.rt_cpus, o.rt_cpus)
    if design == "split-nocap":
        env["LANEGATE_CHUNK_CAP"] = "false"
    return StackPlan(design, {**env, "LANEGATE_LANES": "split"},
                     [WorkerPlan("realtime", o.rt_cpus), WorkerPlan("batch", o.batch_cpus)],
                     o.rt_cpus, o.rt_cpus)


@dataclass
class WhisperBench:
    o: WhisperOptions
    results: dict[str, Any] = field(default_factory=dict)
    stacks: list[dict[str, object]] = field(default_factory=list)

    @property
    def work(self) -> Path:
        return self.o.workdir / "run"

    @contextlib.asynccontextmanager
    async def stack(self, design: str, model: str) -> AsyncIterator[Stack]:
        """A started stack whose realtime lane has decoded once (the first decode pays for
        loading and CTranslate2's warm-up; no measured window should)."""
        async with Stack(whisper_plan(design, self.o, model), self.work) as stack:
            warm, _ = corpus.live_clip(3.0, 99, self.o.workdir)[:2]
            await asyncio.gather(*(accuracy.stream_text(stream_url(stack.url),
                                                        warm.read_bytes(), 2.0)
                                   for _ in self.plan_workers(design)))
            yield stack

    def plan_workers(self, design: str) -> list[WorkerPlan]:
        return whisper_plan(design, self.o, "").workers

    def live_clips(self, n: int, seconds: float) -> list[tuple[Path, str, float]]:
        """``n`` live clips with references; each stream says different sentences."""
        return [corpus.live_clip(seconds, 100 + i, self.o.workdir) for i in range(n)]

    def live_specs(self, url: str, clips: list[tuple[Path, str, float]]) -> list[StreamSpec]:
        return [StreamSpec(kind="live", url=url, pcm_path=str(p), start_s=0.5 * i,
                           duration_s=s) for i, (p, _, s) in enumerate(clips)]

    async def live_window(self, stack: Stack, name: str,
                          clips: list[tuple[Path, str, float]],
                          extra: list[StreamSpec] | None = None) -> dict[str, Any]:
        """``bench.measure.window`` over the clips' streams, with their live WER."""
        specs = self.live_specs(stream_url(stack.url), clips) + (extra or [])
        duration = max(s for _, _, s in clips)
        assert len(specs) <= STREAMS_PER_LOAD_PROCESS  # one load process: results in order
        out = await window(stack, name, specs, self.work, duration)
        raw = json.loads((self.work / f"{name}-load0.out.json").read_text())["results"]
        texts = [" ".join(r["final_text"]) for r in raw[:len(clips)]]
        out["live_wer"] = corpus_wer(zip((ref for _, ref, _ in clips), texts, strict=True))
        out["hyp"] = texts
        out["ref"] = [ref for _, ref, _ in clips]
        return out

    # --- accuracy -----------------------------------------------------------------
    async def accuracy(self, base: str) -> None:
        clips = corpus.clips(self.o.workdir, self.o.per_condition)
        table: dict[str, Any] = {"conditions": [c.name for c in corpus.CONDITIONS],
                                 "clips": len(clips), "raw": {}, "service": {}}
        table["raw"]["pocketsphinx"] = await accuracy.raw("pocketsphinx", "", clips,
                                                          self.o.batch_cpus, self.work)
        for spec in self.o.models:
            path = model_dir(spec)
            if path is None:
                table["raw"][f"whisper-{spec}"] = {"error": "model not installed"}
                continue
            table["raw"][f"whisper-{spec}"] = await accuracy.raw(
                "whisper", path, clips, self.o.batch_cpus, self.work)
            async with self.stack("split", path) as stack:
                self.stacks.append(stack.describe())
                table["service"][f"whisper-{spec}"] = await accuracy.service(
                    stack, clips, self.work, self.o.stream_pace)
        self.results["accuracy"] = table
        print(f"accuracy: { {k: v.get('wer', {}).get('all') for k, v in table['raw'].items()} }"
              f" service { {k: (v['stream']['wer']['all'], v['batch']['wer']['all']) for k, v in table['service'].items()} }",  # noqa: E501
              flush=True)

    # --- realtime -----------------------------------------------------------------
    async def flood(self, stack: Stack) -> list[str]:
        files = [audio.upload_file(self.o.flood_job_s, self.o.workdir, k)
                 for k in range(self.o.flood_jobs)]
        ids = await submit(stack, files)
        await asyncio.sleep(2.0)  # the batch lane under way
        return ids

    @staticmethod
    async def batch_state(stack: Stack, ids: list[str]) -> dict[str, Any]:
        """The flood's jobs at the end of a window: statuses and audio done per second."""
        return throughput(await jobs(stack, ids), time.time())

    async def realtime(self, base: str) -> None:
        clips = self.live_clips(self.o.streams, self.o.live_s)
        rounds = []
        for k in range(self.o.rounds):
            r: dict[str, Any] = {}
            moment = Moment()
            async with self.stack("split", base) as stack:
                if k == 0:
                    self.stacks.append(stack.describe())
                r["alone"] = await self.live_window(stack, "alone", clips)
                ids = await self.flood(stack)
                r["split_flood"] = await self.live_window(stack, "split-flood", clips)
                r["split_flood"]["batch"] = await self.batch_state(stack, ids)
            async with self.stack("mixed", base) as stack:
                if k == 0:
                    self.stacks.append(stack.describe())
                ids = await self.flood(stack)
                r["mixed_flood"] = await self.live_window(stack, "mixed-flood", clips)
                r["mixed_flood"]["batch"] = await self.batch_state(stack, ids)
            r["machine"] = moment.end()
            rounds.append(r)
        self.results["realtime"] = {"rounds": rounds}

    async def capacity(self, base: str) -> None:
        """Live streams on one realtime CPU, stepped up until partial p99 passes the limit."""
        steps = []
        async with self.stack("split", base) as stack:
            for n in range(1, self.o.capacity_max + 1):
                clips = self.live_clips(n, self.o.capacity_s)
                got = await self.live_window(stack, f"capacity-{n}", clips)
                step = {"streams": n, "partial_ms": got["partial_ms"],
                        "partials_per_stream_s": round(got["partial_all_ms"]["count"]
                                                       / max(got["audio_s_sent"], 1.0), 2),
                        "final_ms": got["final_ms"], "live_wer": got["live_wer"],
                        "errors": got["errors"]}
                step["held"] = held(step)
                steps.append(step)
                if not step["held"]:
                    break
        self.results["capacity"] = {
            "steps": steps, "limit_ms": PARTIAL_P99_MS, "final_limit_ms": FINAL_P99_MS,
            "streams_held": max((s["streams"] for s in steps if s["held"]), default=0)}

    async def dump(self, base: str) -> None:
        """Two live streams while one client sends ``dump_s`` of audio in one frame, with
        the cap and without it: the realtime lane's step durations."""
        clips = self.live_clips(self.o.streams, self.o.live_s)
        pcm = self.o.workdir / "dump.pcm"
        if not pcm.exists():
            pcm.write_bytes(audio.speech(self.o.dump_s * 2, self.o.workdir, seed=7))
        out = {}
        for design in ("split", "split-nocap"):
            async with self.stack(design, base) as stack:
                self.stacks.append(stack.describe())
                dumper = dump_spec(stream_url(stack.url), pcm, dump_s=self.o.dump_s,
                                   every_s=1000.0, first_s=6.0, duration_s=10.0)
                out[design] = await self.live_window(stack, f"dump-{design}", clips, [dumper])
        self.results["dump"] = out

    # --- the peer -----------------------------------------------------------------
    async def peer(self, base: str) -> None:
        """WhisperLive and lanegate on the same streams: one stream, two, two plus two
        long uploads; for each, partial lag and live WER."""
        clips = self.live_clips(self.o.streams, self.o.live_s)
        files = [audio.upload_file(self.o.flood_job_s, self.o.workdir, k)
                 for k in range(self.o.flood_jobs)]
        cpus = ",".join(c for c in (self.o.rt_cpus, self.o.batch_cpus) if c)
        server = peer.PeerServer(self.o.peer_venv, base, cpus, self.work / "whisperlive.log")
        theirs: dict[str, Any] = {"server": server.describe()}
        if not (self.o.peer_venv / "bin" / "python").exists():
            self.results["peer"] = {"error": f"no WhisperLive venv at {self.o.peer_venv}"}
            return
        async with peer.running(server):
            theirs["one"] = await peer.window(server, "one", clips[:1], [], self.work,
                                              self.o.peer_tail_s)
            theirs["two"] = await peer.window(server, "two", clips, [], self.work,
                                              self.o.peer_tail_s)
            theirs["two_flood"] = await peer.window(server, "two-flood", clips, files,
                                                    self.work, self.o.peer_tail_s)
        ours: dict[str, Any] = {}
        async with self.stack("split", base) as stack:
            ours["one"] = await self.live_window(stack, "peer-one", clips[:1])
            ours["two"] = await self.live_window(stack, "peer-two", clips)
            ids = await submit(stack, files)
            ours["two_flood"] = await self.live_window(stack, "peer-two-flood", clips)
            ours["two_flood"]["batch"] = await self.batch_state(stack, ids)
        self.results["peer"] = {"whisperlive": theirs, "lanegate": ours}

    async def run(self) -> dict[str, Any]:
        self.work.mkdir(parents=True, exist_ok=True)
        base = model_dir("base")
        if base is None:
            raise SystemExit("Whisper base is not installed (lanegate models)")
        self.results["model_dir"] = base
        started = time.time()
        for part in PARTS:
            if part in self.o.parts:
                t0, moment = time.time(), Moment()
                await getattr(self, part)(base)
                self.results.setdefault("part_wall_s", {})[part] = round(time.time() - t0, 1)
                self.results.setdefault("part_machine", {})[part] = moment.end()
        self.results["run_wall_s"] = round(time.time() - started, 1)
        return self.results


def run(o: WhisperOptions) -> dict[str, Any]:
    """Run the parts asked for; the figures of other parts already in ``whisper.json``
    in ``o.out`` are kept (a part can be run again on its own), each with its command."""
    from bench import report, whisper_report

    o.out.mkdir(parents=True, exist_ok=True)
    path = o.out / "whisper.json"
    earlier = json.loads(path.read_text()) if path.exists() else {}
    bench = WhisperBench(o)
    results = asyncio.run(bench.run())
    command = "python -m bench " + " ".join(sys.argv[1:])
    kept = {k: v for k, v in earlier.get("results", {}).items()
            if k in PARTS and k not in o.parts}
    commands = {k: v for k, v in earlier.get("commands", {}).items() if k in kept}
    commands.update({part: command for part in o.parts})
    walls = {k: v for k, v in earlier.get("results", {}).get("part_wall_s", {}).items()
             if k in kept}
    machines = {k: v for k, v in earlier.get("results", {}).get("part_machine", {}).items()
                if k in kept}
    merged = {**kept, **results, "part_wall_s": {**walls, **results.get("part_wall_s", {})},
              "part_machine": {**machines, **results.get("part_machine", {})}}
    doc: dict[str, Any] = {"command": command, "commands": commands,
                           "machine": report.machine(), "options": o.to_json(),
                           "stacks": bench.stacks, "results": merged}
    doc["verdicts"] = whisper_report.verdicts(doc)
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}", flush=True)
    return doc
