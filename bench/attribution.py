"""Where the gateway's CPU per stream-second goes: the audio frames and the events,
each through the gateway and on two bare servers, in interleaved rounds.

    python -m bench.attribution [--streams 200] [--duration 20] [--rounds 2]
                                [--out bench/results/attribution.json]

Each round runs six windows of the same live streams (scenario 5's stack: two
simulated workers whose steps cost nothing): the gateway as configured, the gateway
with partials off (``partial_interval_ms`` = 100 s: only finals), and each floor
(``bench.floor`` on aiohttp, ``bench.floor_protocol`` on a bare asyncio Protocol)
sending events at the gateway's rate and sending none. Per round, each server's cost
of one event is the CPU its events added over its quiet window, per event, and its
frames' cost is its quiet window's CPU per stream-second (the few events left in it
included). What the gateway spends per frame beyond the floor is the relay of the
audio (the link to the worker, the timeline, the replay buffer); per event beyond the
floor, the worker's event crossing the link, its mapping and the metrics. What
``bench.floor`` spends beyond ``bench.floor_protocol`` is aiohttp's per-message
machinery; what the protocol floor spends is what no Python server on this loop
avoids."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from bench.measure import live_specs, stream_url, window
from bench.run import SCALE_RAMP_PER_S, Bench, Options, free_plan

QUIET_ENV = {"LANEGATE_PARTIAL_INTERVAL_MS": "100000"}
#: the bare servers set beside the gateway: aiohttp's, and one with no WebSocket library
FLOORS = ("floor", "floor_protocol")
SERVERS = ("gateway", *FLOORS)


async def measure_round(bench: Bench, streams: int, duration_s: float) -> dict[str, Any]:
    """The four windows of one round: CPU s per stream-second and events per stream-second."""
    live = bench.live_pcm()
    out: dict[str, Any] = {}
    for quiet in (False, True):
        plan = free_plan(bench.o)
        if quiet:
            plan = dataclasses.replace(plan, env={**plan.env, **QUIET_ENV})
        async with bench.stack(plan) as stack:
            flags = ["--quiet"] if quiet else []
            urls = {"gateway": stack.url}
            for floor in FLOORS:
                urls[floor] = await stack.start_floor(floor, *flags, module=f"bench.{floor}")
            for server, url in urls.items():
                name = server + ("_quiet" if quiet else "")
                specs = live_specs(stream_url(url), streams, duration_s, live,
                                   ramp_s=streams / SCALE_RAMP_PER_S)
                w = await window(stack, name, specs, bench.work, duration_s, server=server)
                out[name] = {
                    "cpu_s_per_stream_s": (w["gateway_steady"] or {}).get("cpu_s_per_stream_s"),
                    "frames_per_stream_s": w["messages"]["sent_per_stream_s"],
                    "events_per_stream_s": w["messages"]["received_per_stream_s"],
                    "errors": w["errors"]}
    return out


def costs(rnd: dict[str, Any], server: str) -> dict[str, float | None]:
    """One server's cost of a frame and of an event (µs of CPU) in one round."""
    loud, quiet = rnd[server], rnd[f"{server}_quiet"]
    cpu, cpu_q = loud["cpu_s_per_stream_s"], quiet["cpu_s_per_stream_s"]
    if cpu is None or cpu_q is None:
        return {"us_per_frame": None, "us_per_event": None}
    extra_events = loud["events_per_stream_s"] - quiet["events_per_stream_s"]
    return {"us_per_frame": round(1e6 * cpu_q / quiet["frames_per_stream_s"], 1),
            "us_per_event": round(1e6 * (cpu - cpu_q) / extra_events, 1)
            if extra_events > 0 else None}


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds, with every round's value."""
    per_round = [{f"{server}_{k}": v for server in SERVERS if server in r
                  for k, v in costs(r, server).items()}
                 | {f"{name}_cpu_s_per_stream_s": r[name]["cpu_s_per_stream_s"] for name in r}
                 for r in rounds]
    out: dict[str, Any] = {}
    for key in per_round[0]:
        values = [r[key] for r in per_round if r[key] is not None]
        out[key] = {"median": statistics.median(values) if values else None,
                    "rounds": [r[key] for r in per_round]}
    return out


async def run(streams: int, duration_s: float, rounds: int, workdir: Path) -> dict[str, Any]:
    bench = Bench(Options(workdir=workdir, scale_streams=(streams,)))
    bench.work.mkdir(parents=True, exist_ok=True)
    measured = []
    for k in range(rounds):
        print(f"round {k + 1}/{rounds}", flush=True)
        measured.append(await measure_round(bench, streams, duration_s))
    return {"streams": streams, "duration_s": duration_s, "rounds": measured,
            "summary": summarize(measured)}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.attribution")
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=Path("bench/.work"))
    p.add_argument("--out", type=Path, default=Path("bench/results/attribution.json"))
    a = p.parse_args()
    doc = asyncio.run(run(a.streams, a.duration, a.rounds, a.workdir))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc["summary"]), flush=True)
    print(f"wrote {a.out}", flush=True)


if __name__ == "__main__":
    main()
