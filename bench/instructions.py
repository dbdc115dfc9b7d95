"""The gateway's instructions per stream-second and per message, counted by valgrind's
callgrind: a figure of the gateway's cost that does not move with the machine's speed,
on every machine (``perf stat`` counts none on a VM without a PMU), beside the same
count for the two floors.

    python -m bench.instructions [--streams 8] [--duration 30]
                                 [--out bench/results/instructions.json]

For each server (the gateway on scenario 5's stack, ``bench.floor``,
``bench.floor_protocol``) one window of live streams: the server runs under
``valgrind --tool=callgrind`` with counting off, ``callgrind_control`` turns it on for
the steady part of the window (every stream connected) and dumps the count at its end.
Under valgrind a server runs some 50 × slower, so the load is small (``--streams``);
its CPU share over the window is reported, and a server near a whole CPU is saturated
and its figure is not the unhindered one. The count depends on the load a little (at
more streams more audio frames share one message on the link), not on the machine's
speed: two runs of the same code give it within a few per cent, where CPU seconds wander
by a fifth.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

from bench.attribution import FLOORS, SERVERS
from bench.measure import live_specs, measured_span, run_load, steady_window, stream_url, summarize
from bench.run import SCALE_RAMP_PER_S, Bench, Options, free_plan
from bench.stack import Stack

#: how long a server started under valgrind may take to listen
READY_UNDER_VALGRIND_S = 300.0
TOTALS = re.compile(r"^(?:totals|summary):\s*(\d+)", re.MULTILINE)


class CallgrindError(RuntimeError):
    pass


def callgrind_prefix(out_dir: Path, name: str) -> tuple[str, ...]:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise CallgrindError("valgrind is not installed (apt-get install valgrind)")
    return (valgrind, "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={out_dir / name}.callgrind.%p")


def dumped_instructions(text: str) -> int:
    """The instruction count of one callgrind dump (its ``totals:`` line)."""
    match = TOTALS.search(text)
    if match is None:
        raise CallgrindError("no totals in the callgrind dump")
    return int(match.group(1))


async def control(pid: int, *args: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "callgrind_control", *args, str(pid), stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise CallgrindError(f"callgrind_control {' '.join(args)}: {err.decode().strip()}")


class CountedSpan:
    """Counting on over the steady part of a window, dumped at its end; the server's
    wall and CPU seconds over it."""

    def __init__(self, stack: Stack, server: str, span: tuple[float, float]) -> None:
        self.stack = stack
        self.server = server
        self.pid = stack.pid(server)
        self.span = span
        self.wall_s = self.cpu_s = 0.0
        self.task: asyncio.Task[None] | None = None

    def start(self, t0_wall: float) -> None:
        self.task = asyncio.create_task(self._count(t0_wall))

    async def _count(self, t0_wall: float) -> None:
        await asyncio.sleep(max(0.0, t0_wall + self.span[0] - time.time()))
        await control(self.pid, "--instr=on")
        began, cpu = time.monotonic(), self.stack.cpu_seconds()[self.server]
        await asyncio.sleep(max(0.0, t0_wall + self.span[1] - time.time()))
        await control(self.pid, "--dump")
        self.wall_s = time.monotonic() - began
        self.cpu_s = self.stack.cpu_seconds()[self.server] - cpu
        await control(self.pid, "--instr=off")


def dump_dir(bench: Bench) -> Path:
    return bench.work / "callgrind"


def latest_dump(out_dir: Path, name: str, pid: int) -> str:
    dumps = sorted(out_dir.glob(f"{name}.callgrind.{pid}.*"),
                   key=lambda p: int(p.suffix.lstrip(".")))
    if not dumps:
        raise CallgrindError(f"{name}: callgrind wrote no dump in {out_dir}")
    return dumps[-1].read_text(errors="replace")


async def measure_server(bench: Bench, server: str, streams: int,
                         duration_s: float) -> dict[str, Any]:
    """One window of ``streams`` live streams on ``server`` under callgrind."""
    out_dir = dump_dir(bench)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(f"{server}.callgrind.*"):
        old.unlink()
    prefix = callgrind_prefix(out_dir, server)
    plan = free_plan(bench.o)
    if server == "gateway":
        plan = dataclasses.replace(plan, gateway_prefix=prefix,
                                   gateway_ready_s=READY_UNDER_VALGRIND_S)
    async with bench.stack(plan) as stack:
        url = stack.url
        if server != "gateway":
            url = await stack.start_floor(server, module=f"bench.{server}", prefix=prefix,
                                          ready_s=READY_UNDER_VALGRIND_S)
        return await counted_window(stack, server, url, bench, streams, duration_s)


async def counted_window(stack: Stack, server: str, url: str, bench: Bench, streams: int,
                         duration_s: float) -> dict[str, Any]:
    specs = live_specs(stream_url(url), streams, duration_s, bench.live_pcm(),
                       ramp_s=streams / SCALE_RAMP_PER_S)
    span = CountedSpan(stack, server, measured_span(specs))
    results, _ = await run_load(specs, bench.work, f"instr-{server}",
                                timeout_s=duration_s + 180, on_start=span.start)
    if span.task is None:
        raise CallgrindError("the load never started")
    await span.task
    dump = latest_dump(dump_dir(bench), server, span.pid)
    instructions = dumped_instructions(dump)
    figures = summarize(results, steady_window(specs))
    msgs = figures["messages"]
    if not msgs["stream_s"]:
        raise CallgrindError(f"{server} carried no stream: {figures['errors']}")
    stream_s = streams * span.wall_s
    per_stream_s = instructions / stream_s
    per_message = per_stream_s / (msgs["sent_per_stream_s"] + msgs["received_per_stream_s"])
    print(f"  [{server}] {per_stream_s / 1e6:.2f} M instructions per stream-second, "
          f"{per_message / 1e3:.0f} k per message", flush=True)
    return {"instructions": instructions, "counted_wall_s": round(span.wall_s, 2),
            "streams": streams, "instructions_per_stream_s": round(per_stream_s),
            "instructions_per_message": round(per_message),
            "frames_per_stream_s": msgs["sent_per_stream_s"],
            "events_per_stream_s": msgs["received_per_stream_s"],
            "cpu_share": round(span.cpu_s / span.wall_s, 2),
            "errors": figures["errors"], "partial_ms": figures["partial_ms"]}


async def run(streams: int, duration_s: float, workdir: Path) -> dict[str, Any]:
    bench = Bench(Options(workdir=workdir, scale_streams=(streams,)))
    bench.work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"streams": streams, "duration_s": duration_s, "servers": {}}
    for server in SERVERS:
        out["servers"][server] = await measure_server(bench, server, streams, duration_s)
    gateway = out["servers"]["gateway"]["instructions_per_stream_s"]
    out["gateway_over"] = {floor: round(gateway / out["servers"][floor]
                                        ["instructions_per_stream_s"], 2)
                           for floor in FLOORS}
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.instructions")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--workdir", type=Path, default=Path("bench/.work"))
    p.add_argument("--out", type=Path, default=Path("bench/results/instructions.json"))
    a = p.parse_args()
    doc = asyncio.run(run(a.streams, a.duration, a.workdir))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k != "servers"}), flush=True)
    print(f"wrote {a.out}", flush=True)


if __name__ == "__main__":
    main()
