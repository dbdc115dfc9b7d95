"""``python -m bench run --scenarios all --out bench/results``: the whole benchmark.

``python -m bench report bench/results/results.json`` re-renders BENCHMARKS.md
and the plots from a results file without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench import plots, report
from bench.run import ALL_SCENARIOS, Options, run

NOTES_FILE = "notes.md"  # hand-written findings in the results directory, appended


def parse_scenarios(raw: str) -> tuple[str, ...]:
    if raw == "all":
        return ALL_SCENARIOS
    wanted = tuple(s.strip() for s in raw.split(",") if s.strip())
    unknown = set(wanted) - set(ALL_SCENARIOS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown scenarios: {sorted(unknown)}")
    return wanted


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="start the stacks, run the scenarios, write the results")
    d = Options()
    r.add_argument("--scenarios", type=parse_scenarios, default=ALL_SCENARIOS,
                   help="all, or a comma list of s1..s6")
    r.add_argument("--out", type=Path, default=d.out)
    r.add_argument("--workdir", type=Path, default=d.workdir)
    r.add_argument("--markdown", type=Path, default=Path("BENCHMARKS.md"))
    for name in ("duration_s", "flood_job_s", "dump_s", "dump_every_s", "sim_duration_s",
                 "sim_dump_s", "scale_duration_s", "vad_seconds"):
        r.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    for name in ("streams", "flood_jobs", "sim_streams", "scale_streams",
                 "scale_mid_streams", "scale_light_streams"):
        r.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    r.add_argument("--rt-cpus", default=d.rt_cpus)
    r.add_argument("--batch-cpus", default=d.batch_cpus)
    r.add_argument("--wav", type=Path, default=None,
                   help="speech for the live streams instead of espeak-ng sentences")
    rep = sub.add_parser("report", help="re-render BENCHMARKS.md and plots from results.json")
    rep.add_argument("results", type=Path)
    rep.add_argument("--markdown", type=Path, default=Path("BENCHMARKS.md"))
    return p


def render(doc: dict[str, object], results_dir: Path, markdown_path: Path) -> None:
    notes_path = results_dir / NOTES_FILE
    notes = notes_path.read_text() if notes_path.exists() else ""
    for path in plots.make_all(doc, results_dir):
        print(f"wrote {path}")
    rel = os.path.relpath(results_dir.resolve(), markdown_path.resolve().parent)
    markdown_path.write_text(report.markdown(doc, notes, rel))
    print(f"wrote {markdown_path}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "report":
        doc = json.loads(args.results.read_text())
        doc["verdicts"] = report.verdicts(doc)  # judged by today's rules
        render(doc, args.results.parent, args.markdown)
        return 0
    fields = {k: v for k, v in vars(args).items() if k not in ("command", "markdown")}
    doc = run(Options(**fields))
    render(doc, args.out, args.markdown)
    for key, v in doc["verdicts"].items():
        print(f"{key}: {'MET' if v['met'] else 'MISSED' if v['met'] is False else '-'} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
