"""``python -m bench run --scenarios all --out bench/results``: the whole benchmark.

``python -m bench report bench/results/results.json`` re-renders BENCHMARKS.md
and the plots from a results file without running anything.

``python -m bench soak --duration-s 3600``: the soak (``bench.soak``), memory over an hour.

``python -m bench gpu``: the GPU run (``bench.gpu``), Whisper base on CUDA float16 in under
10 minutes; ``--toy`` runs it at toy sizes on the CPU.

``python -m bench whisper --parts all --out bench/results/whisper``: the Whisper benchmark
(``bench.whisper_bench``); ``python -m bench whisper-report .../whisper.json`` puts its
BENCHMARKS.md section back after ``report`` rewrote the file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from bench import (
    gpu,
    live_quality,
    plots,
    report,
    sections,
    soak,
    whisper_bench,
    whisper_report,
)
from bench.run import ALL_SCENARIOS, ENGINE_DEFAULTS, ENGINES, Options, run
from bench.whisper_bench import PARTS as WHISPER_PARTS
from bench.whisper_bench import WhisperOptions

NOTES_FILE = "notes.md"  # hand-written findings in the results directory, appended


def parse_scenarios(raw: str) -> tuple[str, ...]:
    if raw == "all":
        return ALL_SCENARIOS
    wanted = tuple(s.strip() for s in raw.split(",") if s.strip())
    unknown = set(wanted) - set(ALL_SCENARIOS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown scenarios: {sorted(unknown)}")
    return wanted


def parse_loads(raw: str) -> tuple[int, ...]:
    try:
        loads = tuple(int(s) for s in raw.split(",") if s.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a comma list of stream counts: {raw}") from exc
    if not loads or min(loads) <= 0:
        raise argparse.ArgumentTypeError(f"stream counts must be positive: {raw}")
    return loads


def positive_int(raw: str) -> int:
    n = int(raw)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {raw}")
    return n


def out_folder(raw: str) -> Path:
    """``--out``: a folder; ``--out x.json`` made a folder named x.json."""
    path = Path(raw)
    if path.suffix.lower() == ".json" or path.is_file():
        raise argparse.ArgumentTypeError(
            f"{raw!r}: give a folder; results.json and the plots are written into it")
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="start the stacks, run the scenarios, write the results")
    d = Options()
    r.add_argument("--scenarios", type=parse_scenarios, default=ALL_SCENARIOS,
                   help="all, or a comma list of s1..s6")
    r.add_argument("--out", type=out_folder, default=d.out,
                   help=f"the folder for results.json and the plots (default {d.out})")
    r.add_argument("--workdir", type=Path, default=d.workdir)
    r.add_argument("--markdown", type=Path, default=Path("BENCHMARKS.md"))
    r.add_argument("--rounds", type=positive_int, default=d.rounds,
                   help="rounds of every design; verdicts on the median of the rounds")
    r.add_argument("--s1-rounds", type=positive_int, default=d.s1_rounds,
                   help="rounds of scenario 1 (those past --rounds run it alone)")
    r.add_argument("--unstable-margin", type=float, default=d.unstable_margin,
                   help="share of a limit within which disagreeing rounds are 'unstable'")
    r.add_argument("--unstable-z", type=float, default=d.unstable_z,
                   help="standard errors of the median within which disagreeing rounds "
                        "are 'unstable' (0: the margin alone decides)")
    r.add_argument("--engine", choices=ENGINES, default=d.engine,
                   help="scenarios 1-3's engine (pocketsphinx: for a host where Whisper "
                        "cannot keep up; the simulated engine keeps 4 and 5)")
    per_engine = ENGINE_DEFAULTS  # these take the engine's figure unless given
    for name in ("duration_s", "s1_duration_s", "flood_job_s", "dump_s", "dump_every_s",
                 "sim_duration_s", "sim_dump_s", "scale_duration_s", "vad_seconds",
                 "protocol_utterance_s"):
        r.add_argument("--" + name.replace("_", "-"), type=float,
                       default=None if name in per_engine["whisper"] else getattr(d, name),
                       help=_per_engine(name))
    for name in ("streams", "flood_jobs", "sim_streams", "scale_target_streams",
                 "protocol_sessions", "protocol_repeats"):
        r.add_argument("--" + name.replace("_", "-"), type=int,
                       default=None if name in per_engine["whisper"] else getattr(d, name),
                       help=_per_engine(name))
    r.add_argument("--scale-streams", type=parse_loads, default=d.scale_streams,
                   help="comma list of gateway loads (streams), e.g. 100,200,500")
    r.add_argument("--rt-cpus", default=d.rt_cpus)
    r.add_argument("--batch-cpus", default=d.batch_cpus)
    r.add_argument("--wav", type=Path, default=None,
                   help="speech for the live streams instead of espeak-ng sentences")
    add_whisper_parsers(sub)
    add_soak_parser(sub)
    add_gpu_parser(sub)
    live_quality.add_parser(sub)
    rep = sub.add_parser("report", help="re-render BENCHMARKS.md and plots from results.json")
    rep.add_argument("results", type=Path)
    rep.add_argument("--markdown", type=Path, default=Path("BENCHMARKS.md"))
    rep.add_argument("--unstable-margin", type=float, default=None,
                     help="judge again with this margin instead of the run's ('inf': "
                          "rounds that disagree are always unstable)")
    rep.add_argument("--unstable-z", type=float, default=None,
                     help="judge again with this many standard errors of the median "
                          "instead of the run's (0: the margin alone decides)")
    return p


def _per_engine(name: str) -> str | None:
    if name not in ENGINE_DEFAULTS["whisper"]:
        return None
    return "default: " + ", ".join(f"{e} {ENGINE_DEFAULTS[e][name]:g}" for e in ENGINES)


def add_whisper_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    w = sub.add_parser("whisper", help="the Whisper benchmark: accuracy, realtime, the peer")
    d = WhisperOptions()
    w.add_argument("--parts", type=whisper_parts, default=d.parts,
                   help=f"all, or a comma list of {','.join(WHISPER_PARTS)}")
    w.add_argument("--models", type=lambda s: tuple(s.split(",")), default=d.models,
                   help="Whisper models of the accuracy table (bundled names or directories)")
    for name in ("out", "workdir", "peer_venv"):
        w.add_argument("--" + name.replace("_", "-"), type=Path, default=getattr(d, name))
    for name in ("stream_pace", "live_s", "flood_job_s", "capacity_s", "dump_s",
                 "peer_tail_s"):
        w.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    for name in ("per_condition", "streams", "flood_jobs", "rounds", "capacity_max"):
        w.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    w.add_argument("--rt-cpus", default=d.rt_cpus)
    w.add_argument("--batch-cpus", default=d.batch_cpus)
    w.add_argument("--markdown", type=Path, default=Path("BENCHMARKS.md"))
    wr = sub.add_parser("whisper-report", help="put the Whisper section back from whisper.json")
    wr.add_argument("results", type=Path)
    wr.add_argument("--markdown", type=Path, default=Path("BENCHMARKS.md"))


def add_soak_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("soak", help="sessions opening and closing for an hour; RSS sampled")
    d = soak.SoakOptions()
    for name in ("out", "workdir"):
        s.add_argument("--" + name, type=Path, default=getattr(d, name))
    s.add_argument("--engine", default=d.engine, help="the workers' engine")
    for name in ("duration_s", "warmup_s", "judge_window_s", "every_s", "session_s",
                 "upload_every_s", "upload_s", "sample_every_s", "limit"):
        s.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    s.add_argument("--rt-cpus", default=d.rt_cpus)
    s.add_argument("--batch-cpus", default=d.batch_cpus)
    s.add_argument("--markdown", type=Path, default=Path("BENCHMARKS.md"))


def add_gpu_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    g = sub.add_parser("gpu", help="Whisper base on one GPU: cost by batch and frames, "
                                   "live streams held, a 25 s flood capped and uncapped")
    d = gpu.GpuOptions()
    g.add_argument("--toy", action="store_true",
                   help="every part at toy sizes on the CPU (CI's check of the script)")
    for name in ("out", "workdir", "wav"):
        g.add_argument("--" + name, type=Path, default=getattr(d, name))
    toy = gpu.GpuOptions.toy_sizes()
    for name in ("device", "compute_type", "model"):
        g.add_argument("--" + name.replace("_", "-"), default=None,
                       help=f"default: {getattr(d, name)} ({getattr(toy, name)} with --toy)")
    g.add_argument("--budget-s", type=float, default=d.budget_s,
                   help="the capacity part steps no further past this (the run stays "
                        "under 10 minutes)")
    g.add_argument("--markdown", type=Path, default=Path("BENCHMARKS.md"))


def gpu_main(args: argparse.Namespace) -> int:
    given = {k: v for k, v in vars(args).items()
             if k in ("out", "workdir", "wav", "device", "compute_type", "model", "budget_s")
             and v is not None}
    o = gpu.GpuOptions.toy_sizes(**given) if args.toy else gpu.GpuOptions(**given)
    if o.device == "cuda" and gpu.gpu_name() is None:
        print("python -m bench gpu: no CUDA device is visible (CTranslate2 counts none); "
              "--toy runs it on the CPU at toy sizes", file=sys.stderr)
        return 2
    doc = gpu.run(o)
    gpu.write_section(doc, args.markdown)
    print(f"wrote {args.markdown}")
    cap = doc["results"].get("capacity", {})
    print(f"streams held at p99 <= {cap.get('limit_ms')} ms: {cap.get('streams_held')}")
    return 0


def soak_main(args: argparse.Namespace) -> int:
    fields = {k: v for k, v in vars(args).items() if k not in ("command", "markdown")}
    doc = soak.run(soak.SoakOptions(**fields), args.markdown)
    m = doc["memory"]
    print(f"wrote {args.markdown}; soak memory: {m['verdict']} "
          f"(worst growth {m.get('worst_growth')}); errors {doc['session_errors']}")
    return 0 if m["verdict"] == "met" else 1


def whisper_parts(raw: str) -> tuple[str, ...]:
    if raw == "all":
        return WHISPER_PARTS
    wanted = tuple(s.strip() for s in raw.split(",") if s.strip())
    unknown = set(wanted) - set(WHISPER_PARTS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown parts: {sorted(unknown)}")
    return wanted


def whisper_main(args: argparse.Namespace) -> int:
    if args.command == "whisper-report":
        doc = json.loads(args.results.read_text())
        doc["verdicts"] = whisper_report.verdicts(doc)
    else:
        fields = {k: v for k, v in vars(args).items() if k not in ("command", "markdown")}
        doc = whisper_bench.run(WhisperOptions(**fields))
    whisper_report.write_section(doc, args.markdown)
    print(f"wrote {args.markdown}")
    for key, v in doc["verdicts"].items():
        print(f"{key}: {v['verdict']} {v.get('check', '')} {v.get('median', '')}")
    return 0


def render(doc: dict[str, object], results_dir: Path, markdown_path: Path) -> None:
    notes_path = results_dir / NOTES_FILE
    notes = notes_path.read_text() if notes_path.exists() else ""
    for path in plots.make_all(doc, results_dir):
        print(f"wrote {path}")
    rel = os.path.relpath(results_dir.resolve(), markdown_path.resolve().parent)
    old = markdown_path.read_text() if markdown_path.exists() else ""
    markdown_path.write_text(report.markdown(doc, notes, rel) + sections.kept(old))
    print(f"wrote {markdown_path}")
    print(f"for the README: {report.readme_summary(doc)}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("whisper", "whisper-report"):
        return whisper_main(args)
    if args.command == "soak":
        return soak_main(args)
    if args.command == "gpu":
        return gpu_main(args)
    if args.command == "live-quality":
        return live_quality.main(args)
    if args.command == "report":
        doc = report.upgrade(json.loads(args.results.read_text()))
        if args.unstable_margin is not None:
            doc["options"]["unstable_margin"] = args.unstable_margin
        if args.unstable_z is not None:
            doc["options"]["unstable_z"] = args.unstable_z
        doc["verdicts"] = report.verdicts(doc)  # judged by today's rules
        render(doc, args.results.parent, args.markdown)
        print_verdicts(doc)
        return 0
    fields = {k: v for k, v in vars(args).items() if k not in ("command", "markdown")}
    doc = run(Options(**fields))
    render(doc, args.out, args.markdown)
    print_verdicts(doc)
    return 0


def print_verdicts(doc: dict[str, Any]) -> None:
    for key, v in doc["verdicts"].items():
        checks = "; ".join(f"{c['check']} {c.get('median', '')} {c['verdict']}"
                           for c in v["checks"])
        print(f"{key}: {v['verdict'].upper()}: {checks}")


if __name__ == "__main__":
    sys.exit(main())
