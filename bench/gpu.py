"""``python -m bench gpu``: one prepared script for the day a GPU is lent (under 10 min).

Whisper base (bundled) on CUDA float16, three parts, written to ``results-gpu.json``
in ``--out`` and to BENCHMARKS.md's GPU section (its own markers: a re-render of the
rest keeps it):

* **cost**: the engine's encoder and decoder time against batch size and frames
  (``WhisperEngine.decode`` on the shared recording cut to each length, as
  ``bench.whisper_cost`` does on a CPU), and the cost model's fit on that card;
* **capacity**: the live streams one GPU holds at partial p99 <= 300 ms with the
  cap on: a split stack (one realtime worker on the GPU), streams of the shared
  recording stepped up until a step misses the red line or errs;
* **flood**: on the same GPU, live streams while dumper sessions each send a 25 s
  segment in one frame (so it enters the live batch), uncapped (``split-nocap``)
  against capped (``split``): the seed's stall, and how the cap bounds it; step
  histograms from the worker's ``/metrics``.

``--toy`` runs every part at toy sizes on the CPU (int8): CI runs it
(tests/test_bench_gpu.py) so the script never rots before a device is lent. Its
figures say nothing about a GPU and the section says so.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench import audio
from bench.audio import SHARED_SPEECH
from bench.measure import dump_spec, live_specs, stream_url, window
from bench.run import COMMON_ENV
from bench.sections import GPU
from bench.stack import Stack, StackPlan, WorkerPlan
from bench.verdict import RED_LINE_MS


@dataclass
class GpuOptions:
    out: Path = Path("bench/results/gpu")
    workdir: Path = Path("bench/.work/gpu")
    device: str = "cuda"
    compute_type: str = "float16"
    model: str = "base"
    wav: Path = SHARED_SPEECH  # the live speech and the cost part's audio
    # cost: segment lengths (s) and batch sizes
    seconds: tuple[float, ...] = (3.0, 6.0, 10.0, 16.0, 25.0)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    # capacity: stream counts stepped through (stopping at the first that misses)
    streams: tuple[int, ...] = (4, 8, 16, 24, 32, 48, 64)
    capacity_s: float = 30.0
    # flood: live streams, dumpers, each dump's length (the batch lane's 25 s segment)
    flood_streams: int = 16
    dumpers: int = 4
    dump_s: float = 25.0
    flood_s: float = 40.0
    slots: int = 96
    budget_s: float = 540.0  # the capacity part stops stepping past this (under 10 min)
    toy: bool = False

    @classmethod
    def toy_sizes(cls, **over: Any) -> GpuOptions:
        """Every part on the CPU at toy sizes: the code paths, not the figures."""
        return replace(cls(device="cpu", compute_type="int8", seconds=(2.0, 4.0),
                           batches=(1, 2), streams=(1, 2), capacity_s=6.0, flood_streams=1,
                           dumpers=1, dump_s=6.0, flood_s=12.0, slots=8, toy=True), **over)

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


def plan(design: str, o: GpuOptions) -> StackPlan:
    """One realtime worker on the device (and a batch worker: the stack's usual shape;
    it gets no jobs here). ``split-nocap``: the step budget's cap off."""
    env = {**COMMON_ENV, "LANEGATE_ENGINE": "whisper", "LANEGATE_WHISPER_MODEL": o.model,
           "LANEGATE_DEVICE": o.device, "LANEGATE_COMPUTE_TYPE": o.compute_type,
           "LANEGATE_LANES": "split", "LANEGATE_SLOTS": str(o.slots),
           "LANEGATE_MAX_FRAME_BYTES": str(int(o.dump_s * 32000) + 1_048_576),
           "LANEGATE_MAX_UNDECODED_S": str(o.dump_s + 60)}
    if design == "split-nocap":
        env["LANEGATE_CHUNK_CAP"] = "false"
    return StackPlan(design, env, [WorkerPlan("realtime")])


@dataclass
class GpuBench:
    o: GpuOptions
    results: dict[str, Any] = field(default_factory=dict)
    stacks: list[dict[str, object]] = field(default_factory=list)

    @property
    def work(self) -> Path:
        return self.o.workdir / "run"

    def live_pcm(self) -> Path:
        path = self.o.workdir / "live.pcm"
        if not path.exists():
            path.write_bytes(audio.read_wav(self.o.wav))
        return path

    # --- cost ---------------------------------------------------------------------
    def cost(self) -> None:
        from engines.whisper import Job, WhisperEngine, as_float
        from lanegate.settings import ComputeType, Device, Settings
        from lanes.cost import CostModel

        settings = Settings(data_dir=tempfile.mkdtemp(), device=Device(self.o.device),
                            compute_type=ComputeType(self.o.compute_type),
                            whisper_model=self.o.model)
        engine = WhisperEngine(settings, slots=max(self.o.batches))
        speech = as_float(audio.read_wav(self.o.wav))
        engine.decode([Job(speech[: 16000 * 2], "en")])  # the warm-up call is not measured
        cost = CostModel.from_prior(engine.cost_prior(), alpha=0.2)
        rows = []
        for seconds in self.o.seconds:
            reps = int(np.ceil(seconds * 16000 / len(speech)))
            clip = np.tile(speech, reps)[: int(seconds * 16000)]
            for batch in self.o.batches:
                t0 = time.perf_counter()
                engine.decode([Job(clip, "en") for _ in range(batch)])
                total = time.perf_counter() - t0
                p = engine.last_profile()
                assert p is not None
                cost.observe_profile(total, p)
                rows.append({"seconds": seconds, "frames": p.frames, "batch": batch,
                             "encode_ms": round(p.encode_s * 1000, 2),
                             "decode_ms": round(p.decode_s * 1000, 2), "tokens": p.tokens,
                             "total_ms": round(total * 1000, 2)})
                print(f"  cost {seconds:g} s x {batch}: {rows[-1]}", flush=True)
        r = cost.redecode
        fit = None if r is None else {
            "encoder_s_per_kframe": float(r.encoder.coef[0]),
            "encoder_s_per_kframe2": float(r.encoder.coef[1]),
            "decoder_ms_per_seq": float(r.decoder.coef[0] * 1000),
            "decoder_ms_per_step": float(r.decoder.coef[1] * 1000), "spread": cost.spread}
        self.results["cost"] = {"device": engine.device, "compute_type": engine.compute_type,
                                "rows": rows, "fit": fit}

    # --- capacity -----------------------------------------------------------------
    async def capacity(self, deadline: float) -> None:
        steps: list[dict[str, Any]] = []
        async with Stack(plan("split", self.o), self.work) as stack:
            self.stacks.append(stack.describe())
            url = stream_url(stack.url)
            live = self.live_pcm()
            await window(stack, "warm", live_specs(url, 1, 3.0, live), self.work, 3.0)
            for n in self.o.streams:
                if time.monotonic() > deadline:
                    steps.append({"streams": n, "skipped": "past the time budget"})
                    break
                got = await window(stack, f"capacity-{n}",
                                   live_specs(url, n, self.o.capacity_s, live, ramp_s=2.0),
                                   self.work, self.o.capacity_s)
                p99 = got["partial_ms"]["p99"]
                step = {"streams": n, "partial_ms": got["partial_ms"],
                        "stalled_streams": got["stalled_streams"],
                        "final_ms": got["final_ms"], "errors": got["errors"],
                        "steps": got["steps"].get("realtime"),
                        "held": p99 is not None and p99 <= RED_LINE_MS and not got["errors"]}
                steps.append(step)
                if not step["held"]:
                    break
        held = [int(s["streams"]) for s in steps if s.get("held")]
        self.results["capacity"] = {"limit_ms": RED_LINE_MS, "steps": steps,
                                    "streams_held": max(held, default=0)}

    # --- flood --------------------------------------------------------------------
    async def flood(self) -> None:
        out: dict[str, Any] = {}
        live = self.live_pcm()
        dump = self.o.workdir / "dump.pcm"
        if not dump.exists():
            one = audio.read_wav(self.o.wav)
            need = int(self.o.dump_s * 32000) + 32000
            dump.write_bytes((one * (need // len(one) + 1))[:need])
        d = self.o.flood_s
        for design in ("split-nocap", "split"):
            async with Stack(plan(design, self.o), self.work) as stack:
                self.stacks.append(stack.describe())
                url = stream_url(stack.url)
                await window(stack, "warm", live_specs(url, 1, 3.0, live), self.work, 3.0)
                specs = live_specs(url, self.o.flood_streams, d, live)
                specs += [dump_spec(url, dump, dump_s=self.o.dump_s,
                                    every_s=self.o.dump_s + 5.0, first_s=3.0 + k,
                                    duration_s=d - 4.0) for k in range(self.o.dumpers)]
                got = await window(stack, f"flood-{design}", specs, self.work, d)
                out[design] = {"partial_ms": got["partial_ms"],
                               "stalled_streams": got["stalled_streams"],
                               "steps": got["steps"].get("realtime"),
                               "dump": got.get("dump"), "errors": got["errors"],
                               "timeline_worst_ms": got["timeline_worst_ms"]}
        self.results["flood"] = out

    async def run(self) -> dict[str, Any]:
        self.work.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        deadline = started + self.o.budget_s
        t0 = time.monotonic()
        await asyncio.to_thread(self.cost)
        walls = {"cost": time.monotonic() - t0}
        t0 = time.monotonic()
        await self.flood()  # before capacity: the capacity part uses what time is left
        walls["flood"] = time.monotonic() - t0
        t0 = time.monotonic()
        await self.capacity(deadline)
        walls["capacity"] = time.monotonic() - t0
        self.results["part_wall_s"] = {k: round(v, 1) for k, v in walls.items()}
        self.results["run_wall_s"] = round(time.monotonic() - started, 1)
        return self.results


def run(o: GpuOptions) -> dict[str, Any]:
    from bench import report

    o.out.mkdir(parents=True, exist_ok=True)
    bench = GpuBench(o)
    results = asyncio.run(bench.run())
    doc: dict[str, Any] = {"command": "python -m bench " + " ".join(sys.argv[1:]),
                           "machine": report.machine(), "gpu": gpu_name(),
                           "options": o.to_json(), "stacks": bench.stacks, "results": results}
    path = o.out / "results-gpu.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}", flush=True)
    return doc


def gpu_name() -> str | None:
    try:
        import ctranslate2
        if ctranslate2.get_cuda_device_count() < 1:
            return None
    except (ImportError, RuntimeError):
        return None
    import subprocess
    got = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False)
    return got.stdout.strip() or "a CUDA device"


# --- BENCHMARKS.md --------------------------------------------------------------------


def _ms(v: Any) -> str:
    return "—" if v is None else f"{float(v):.0f}"


def section(doc: dict[str, Any]) -> str:
    o, r = doc["options"], doc["results"]
    head = ("**Toy run on the CPU** (`--toy`, CI's check that the script works): these "
            "figures say nothing about a GPU." if o.get("toy") else
            f"On {doc.get('gpu') or 'no GPU (device ' + o['device'] + ')'}.")
    lines = [GPU.begin, "## GPU: Whisper base on one card", "",
             f"Generated by `{doc['command']}` in {r.get('run_wall_s')} s; the figures are "
             f"in `{o['out']}/results-gpu.json`. {head} Whisper {o['model']} "
             f"{r.get('cost', {}).get('compute_type', o['compute_type'])} on "
             f"{r.get('cost', {}).get('device', o['device'])}.", ""]
    cost = r.get("cost")
    if cost:
        batches = sorted({row["batch"] for row in cost["rows"]})
        lines += ["Encoder ms / decoder ms (decoder steps) per call, by segment and batch:",
                  "", "| segment (frames) | " + " | ".join(f"batch {b}" for b in batches)
                  + " |", "|---|" + "---|" * len(batches)]
        for seconds in sorted({row["seconds"] for row in cost["rows"]}):
            cells = {row["batch"]: row for row in cost["rows"] if row["seconds"] == seconds}
            frames = next(iter(cells.values()))["frames"]
            lines.append(f"| {seconds:g} s ({frames}) | " + " | ".join(
                f"{cells[b]['encode_ms']:.0f} / {cells[b]['decode_ms']:.0f} "
                f"({cells[b]['tokens']})" if b in cells else "—" for b in batches) + " |")
        fit = cost.get("fit")
        if fit:
            lines += ["", f"The cost model's fit on this card: encoder "
                      f"{fit['encoder_s_per_kframe']:.4f} s × kF + "
                      f"{fit['encoder_s_per_kframe2']:.4f} s × kF² per sequence; decoder "
                      f"{fit['decoder_ms_per_seq']:.1f} ms per sequence + "
                      f"{fit['decoder_ms_per_step']:.2f} ms per step; spread "
                      f"{fit['spread']:.2f}."]
        lines.append("")
    cap = r.get("capacity")
    if cap:
        lines += [f"Live streams of the shared recording on one card, capped, stepped up "
                  f"until partial p99 passed {cap['limit_ms']:.0f} ms: **"
                  f"{cap['streams_held']} held**.", "",
                  "| streams | partial p99 (ms) | max (ms) | stalled | final p99 (ms) | "
                  "step p99 (ms) | errors | held |", "|---|---|---|---|---|---|---|---|"]
        for s in cap["steps"]:
            if "skipped" in s:
                lines.append(f"| {s['streams']} | {s['skipped']} | | | | | | |")
                continue
            lines.append(f"| {s['streams']} | {_ms(s['partial_ms']['p99'])} | "
                         f"{_ms(s['partial_ms']['max'])} | {s['stalled_streams']} | "
                         f"{_ms(s['final_ms']['p99'])} | "
                         f"{_ms((s.get('steps') or {}).get('p99_ms'))} | "
                         f"{s['errors'] or '—'} | {'yes' if s['held'] else 'no'} |")
        lines.append("")
    flood = r.get("flood")
    if flood:
        lines += [f"{o['flood_streams']} live streams while {o['dumpers']} sessions each send "
                  f"{o['dump_s']:g} s in one frame (into the live batch), "
                  f"{o['flood_s']:g} s windows:", "",
                  "| design | live partial p99 (ms) | max (ms) | stalled | step p99 (ms) | "
                  "steps over 50 ms | step max at most (ms) | dump digested in (s) |",
                  "|---|---|---|---|---|---|---|---|"]
        for design, f in flood.items():
            st = f.get("steps") or {}
            digest = (f.get("dump") or {}).get("digest_s") or []
            lines.append(f"| `{design}` | {_ms(f['partial_ms']['p99'])} | "
                         f"{_ms(f['partial_ms']['max'])} | {f['stalled_streams']} | "
                         f"{_ms(st.get('p99_ms'))} | {st.get('over_50ms', '—')} | "
                         f"{_ms(st.get('max_at_most_ms'))} | "
                         f"{', '.join(f'{v:.1f}' for v in digest) or '—'} |")
        lines.append("")
    lines.append(GPU.end)
    return "\n".join(lines)


def write_section(doc: dict[str, Any], markdown_path: Path) -> None:
    GPU.put(section(doc), markdown_path)
