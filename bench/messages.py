"""Messages per stream-second: one short window of live streams on the simulated engine,
counting the events each client receives and the gateway's CPU per stream-second.

    python -m bench.messages --streams 120 --duration 20 [--plan free] [--set NAME=VALUE ...]

The stack is scenario 4's (``run.sim_plan``, capped, no dump), or with ``--plan free``
scenario 5's (``run.free_plan``: two workers whose steps cost nothing); each stream sends the
same speech-like audio in 100 ms frames at real time. ``--set NAME=VALUE`` gives every
process of the stack the setting ``LANEGATE_NAME`` (to compare a setting's cost in
interleaved runs: the machine's speed wanders by a fifth between runs). Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import json
from pathlib import Path
from typing import Any

from bench.measure import live_specs, stream_url, window
from bench.run import Bench, Options, free_plan, sim_plan


class Plan(enum.StrEnum):
    CAP = "cap"  # scenario 4's stack
    FREE = "free"  # scenario 5's


async def measure(streams: int, duration_s: float, workdir: Path,
                  settings: dict[str, str] | None = None, plan: Plan = Plan.CAP,
                  ) -> dict[str, Any]:
    options = Options(workdir=workdir, sim_streams=streams, sim_duration_s=duration_s,
                      scale_streams=(streams,))
    bench = Bench(options)
    bench.work.mkdir(parents=True, exist_ok=True)
    live = bench.speech_pcm("live", 180, 1)
    stack_plan = (free_plan(options) if plan is Plan.FREE
                  else sim_plan("sim-cap", options, cap=True))
    stack_plan = dataclasses.replace(stack_plan, env={**stack_plan.env, **(settings or {})})
    async with bench.stack(stack_plan) as stack:
        specs = live_specs(stream_url(stack.url), streams, duration_s, live, ramp_s=5.0)
        out = await window(stack, "messages", specs, bench.work, duration_s)
    stream_s = out["audio_s_sent"]
    partials, finals = out["partial_all_ms"]["count"], out["final_ms"]["count"]
    return {
        "streams": streams, "duration_s": duration_s, "stream_s": stream_s,
        "partials": partials, "finals": finals,
        "events_per_stream_s": round((partials + finals) / stream_s, 2),
        "partials_per_stream_s": round(partials / stream_s, 2),
        "gateway_cpu_ms_per_stream_s": round(1000 * out["gateway_cpu_s"] / stream_s, 3),
        "gateway_steady": out["gateway_steady"],
        "partial_ms": out["partial_ms"], "errors": out["errors"],
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.messages")
    p.add_argument("--streams", type=int, default=120)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--workdir", type=Path, default=Path("bench/.work"))
    p.add_argument("--plan", type=Plan, choices=list(Plan), default=Plan.CAP,
                   help="cap: scenario 4's stack; free: scenario 5's")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   type=setting, help="a setting for every process (LANEGATE_NAME)")
    a = p.parse_args()
    print(json.dumps(asyncio.run(measure(a.streams, a.duration, a.workdir, dict(a.set),
                                        a.plan))),
          flush=True)


def setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return "LANEGATE_" + name.upper().removeprefix("LANEGATE_"), value


if __name__ == "__main__":
    main()
