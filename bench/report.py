"""The machine description, the verdict on each target, and BENCHMARKS.md."""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import protocols
from bench.machine import PROBE_LOOP
from bench.verdict import (
    MAD_TO_SIGMA,
    RED_LINE_MS,
    UNSTABLE_MARGIN,
    UNSTABLE_Z,
    WHISPER_CPU_P99_MS,
    Check,
    Rule,
    combine,
    judge,
    judge_flags,
    ratio,
    spread,
)

PACKAGES = ("aiohttp", "redis", "pocketsphinx", "webrtcvad-wheels", "prometheus-client",
            "numpy", "soxr", "av", "structlog", "matplotlib", "faster-whisper",
            "ctranslate2", "lanegate")


def _cmd(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def mem_total_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 1024 / 1024, 1)
    return 0.0


def versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def machine() -> dict[str, Any]:
    return {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nproc": os.cpu_count(), "cpu_model": cpu_model(), "mem_gib": mem_total_gib(),
        "kernel": platform.release(), "python": sys.version.split()[0],
        "redis_server": _cmd(["redis-server", "--version"]),
        "espeak_ng": _cmd(["espeak-ng", "--version"]),
        "packages": versions(),
        "git_commit": _cmd(["git", "rev-parse", "HEAD"]),
        "git_dirty_files": len(_cmd(["git", "status", "--porcelain"]).splitlines()),
        "load_avg_at_start": list(os.getloadavg()),
    }


# --- verdicts ----------------------------------------------------------------------
# Every figure a target names is taken per round, then judged by bench.verdict's rule.

Windows = dict[str, Any]
#: the gateway's targets: its CPU per stream-second at most this many times the same
#: round's floor (``bench.floor``, a bare aiohttp server under the same streams; the
#: median of the per-round ratios), and the partial latency it adds at p99. (The
#: absolute target it replaces, 0.0005 CPU s per stream-second, was below what the
#: bare server itself costs on these hosts: 0.0002-0.0008 in 16 runs.)
GATEWAY_OVER_FLOOR = 2.0
ADDED_P99_MS = 10.0
#: batch lane on Whisper against faster-whisper's BatchedInferencePipeline on the same
#: audio, model and threads: at least this share of its throughput ...
BATCHED_SHARE = 0.9
#: ... at a WER at most this much above its WER (equal or better)
BATCHED_WER_SLACK = 0.0


def engine_of(o: dict[str, Any]) -> str:
    """Scenarios 1-3's engine (a results file from before ``--engine``: pocketsphinx)."""
    return str(o.get("engine", "pocketsphinx"))


def live_limit_ms(o: dict[str, Any]) -> float:
    """The partial p99 scenarios 1-2 judge: the red line, or Whisper's on a CPU."""
    return WHISPER_CPU_P99_MS if engine_of(o) == "whisper" else RED_LINE_MS


def round_windows(doc: dict[str, Any]) -> list[Windows]:
    return [rnd["windows"] for rnd in doc["results"].get("rounds", [])]


def _p99(w: Windows, key: str) -> float | None:
    v = w.get(key, {}).get("partial_ms", {}).get("p99")
    return None if v is None else float(v)


def _p99_any(w: Windows, key: str) -> float | None:
    """The window's p99, or when no partial came while every stream was on (a design
    that falls seconds behind), the p99 of every partial the streams got, late ones too."""
    p = _p99(w, key)
    v = w.get(key, {}).get("partial_all_ms", {}).get("p99") if p is None else p
    return None if v is None else float(v)


def _served(w: Windows, key: str) -> bool | None:
    """Every stream of the window was served to its end without an error (None: not run)."""
    res = w.get(key)
    return None if not res else not res.get("errors")


def _steps(res: dict[str, Any]) -> dict[str, Any]:
    steps: dict[str, Any] = res.get("steps", {})
    return steps.get("realtime") or steps.get("mixed") or {}


def _errors(ws: list[Windows], keys: tuple[str, ...]) -> dict[str, Any]:
    return {f"{k} round {i + 1}": w[k]["errors"] for i, w in enumerate(ws) for k in keys
            if w.get(k, {}).get("errors")}


def _verdict(target: str, checks: list[dict[str, Any]], figures: dict[str, Any],
             **extra: Any) -> dict[str, Any]:
    return {"target": target, "verdict": combine([c["verdict"] for c in checks]).value,
            "checks": checks, "figures": figures, **extra}


def partials_per_stream_s(w: Windows, key: str) -> float | None:
    """Partials the live streams got per second of their audio (late ones too)."""
    res = w.get(key)
    if not res or not res.get("audio_s_sent"):
        return None
    return float(res["partial_all_ms"]["count"]) / float(res["audio_s_sent"])


def batch_rate(w: Windows, key: str) -> float | None:
    """Batch audio seconds done per wall second during the window ``key``."""
    v = (w.get(key, {}).get("batch_during_window") or {}).get("audio_s_per_wall_s")
    return None if v is None else float(v)


def ran_dry(w: Windows, key: str) -> bool:
    """Whether every upload of the window's flood had finished before the window ended:
    its batch figure is then the flood's size over its time, not what the lane could do
    over the window (``measure.throughput`` records ``ran_dry_s``; files from before it
    show it as every job completed)."""
    b = w.get(key, {}).get("batch_during_window") or {}
    return "ran_dry_s" in b or (bool(b.get("jobs")) and b.get("completed") == b.get("jobs"))


def longest_wait(w: Windows, key: str) -> float | None:
    """The window's worst stream's longest wait for a partial (ms); None before it was
    measured."""
    v = (w.get(key, {}).get("longest_wait_ms") or {}).get("max")
    return None if v is None else float(v)


def stalled_streams(w: Windows, key: str) -> int | None:
    res = w.get(key)
    return None if not res else int(res.get("stalled_streams", 0))


def verdict_s1(ws: list[Windows], rule: Rule, limit: float = RED_LINE_MS) -> dict[str, Any]:
    alone = [_p99(w, "s1_alone") for w in ws]
    split = [_p99(w, "s1_split") for w in ws]
    mixed = [_p99_any(w, "s1_mixed") for w in ws]
    checks = [judge(Check("split_over_alone", 1.25),
                    [ratio(s, a) for s, a in zip(split, alone, strict=True)], rule),
              judge(Check("split_p99_ms", limit), split, rule),
              judge_flags("every stream served (split)", [_served(w, "s1_split") for w in ws])]
    return _verdict(f"split partial p99 <= 1.25 x alone p99 (same round) and <= {limit:g} ms",
                    checks, {"alone_p99_ms": spread(alone), "mixed_p99_ms": spread(mixed),
                             "mixed_over_alone": spread([ratio(m, a) for m, a in
                                                         zip(mixed, alone, strict=True)]),
                             "mixed_stalled_streams": spread(
                                 [stalled_streams(w, "s1_mixed") for w in ws]),
                             "split_partials_per_stream_s": spread(
                                 [partials_per_stream_s(w, "s1_split") for w in ws]),
                             "mixed_partials_per_stream_s": spread(
                                 [partials_per_stream_s(w, "s1_mixed") for w in ws]),
                             "split_batch_audio_s_per_wall_s": spread(
                                 [batch_rate(w, "s1_split") for w in ws]),
                             "mixed_batch_audio_s_per_wall_s": spread(
                                 [batch_rate(w, "s1_mixed") for w in ws])},
                    errors=_errors(ws, ("s1_alone", "s1_split", "s1_mixed")))


def verdict_s2(ws: list[Windows], rule: Rule, limit: float = RED_LINE_MS) -> dict[str, Any]:
    cap = [_p99(w, "s2_split") for w in ws]
    nocap = [_p99(w, "s2_split_nocap") for w in ws]
    checks = [judge(Check("split_p99_ms", limit), cap, rule),
              judge_flags("every stream served (split)", [_served(w, "s2_split") for w in ws])]
    return _verdict(f"with the cap, the other streams' partial p99 <= {limit:g} ms while one "
                    "client dumps 10 s", checks,
                    {"split_nocap_p99_ms": spread(nocap),
                     "nocap_over_split": spread([ratio(n, c) for n, c in
                                                 zip(nocap, cap, strict=True)]),
                     "split_step_p99_ms": spread([_steps(w.get("s2_split", {})).get("p99_ms")
                                                  for w in ws]),
                     "split_nocap_step_p99_ms": spread(
                         [_steps(w.get("s2_split_nocap", {})).get("p99_ms") for w in ws])},
                    errors=_errors(ws, ("s2_split", "s2_split_nocap")))


def verdict_s3(ws: list[Windows], rule: Rule, engine: str = "pocketsphinx") -> dict[str, Any]:
    tput = [w.get("s3_split_batch", {}).get("audio_s_per_wall_s") for w in ws]
    if engine == "whisper":
        return verdict_s3_whisper(ws, rule, tput)
    ceil = [w.get("ceiling", {}).get("audio_s_per_wall_s") for w in ws]
    share = [ratio(t, c) for t, c in zip(tput, ceil, strict=True)]
    return _verdict("split batch throughput >= 90% of the raw engine on the same core "
                    "(same round)",
                    [judge(Check("share_of_ceiling", 0.9, at_most=False, share=True), share,
                           rule)],
                    {"split_audio_s_per_wall_s": spread(tput),
                     "ceiling_audio_s_per_wall_s": spread(ceil)})


def verdict_s3_whisper(ws: list[Windows], rule: Rule,
                       tput: list[float | None]) -> dict[str, Any]:
    """The batch lane in the service against faster-whisper's BatchedInferencePipeline
    (and lanegate's own batch call outside the service) on one flood upload, the same
    model, compute type and threads, on the batch CPU in the same round."""
    theirs = [(w.get("ceiling") or {}).get("faster_whisper") or {} for w in ws]
    raw = [(w.get("ceiling") or {}).get("lanegate") or {} for w in ws]
    ours_wer = [w.get("s3_split_batch", {}).get("wer") for w in ws]
    their_wer = [t.get("wer") for t in theirs]
    share = [ratio(t, f.get("audio_s_per_wall_s")) for t, f in zip(tput, theirs, strict=True)]
    wer_gap = [None if a is None or b is None else a - b
               for a, b in zip(ours_wer, their_wer, strict=True)]
    return _verdict(f"split batch throughput >= {BATCHED_SHARE:.0%} of faster-whisper's "
                    "BatchedInferencePipeline on the same audio, model and threads (same "
                    "round) at an equal or better WER",
                    [judge(Check("share_of_batched_pipeline", BATCHED_SHARE, at_most=False,
                                 share=True), share, rule),
                     judge(Check("wer_minus_batched_pipeline_wer", BATCHED_WER_SLACK),
                           wer_gap, rule)],
                    {"split_audio_s_per_wall_s": spread(tput),
                     "batched_pipeline_audio_s_per_wall_s": spread(
                         [f.get("audio_s_per_wall_s") for f in theirs]),
                     "raw_transcribe_batch_audio_s_per_wall_s": spread(
                         [r.get("audio_s_per_wall_s") for r in raw]),
                     "share_of_raw_transcribe_batch": spread(
                         [ratio(t, r.get("audio_s_per_wall_s"))
                          for t, r in zip(tput, raw, strict=True)]),
                     "split_wer": spread(ours_wer), "batched_pipeline_wer": spread(their_wer),
                     "raw_transcribe_batch_wer": spread([r.get("wer") for r in raw])})


def verdict_s4(ws: list[Windows], rule: Rule) -> dict[str, Any]:
    cap = [_steps(w.get("s4_sim-cap", {})) for w in ws]
    nocap = [_steps(w.get("s4_sim-nocap", {})) for w in ws]
    checks = [judge(Check("cap_share_le_50ms", 0.99, at_most=False, share=True),
                    [c.get("share_le_50ms") for c in cap], rule),
              judge_flags("every stream served (cap)", [_served(w, "s4_sim-cap") for w in ws])]
    return _verdict("with the cap >= 99% of steps in the <= 50 ms buckets, every stream "
                    "served; without it, the stall", checks,
                    {"cap_step_p99_ms": spread([c.get("p99_ms") for c in cap]),
                     "nocap_step_p99_ms": spread([c.get("p99_ms") for c in nocap]),
                     "nocap_share_le_50ms": spread([c.get("share_le_50ms") for c in nocap]),
                     "cap_steps_over_50ms": spread([c.get("over_50ms") for c in cap]),
                     "nocap_steps_over_50ms": spread([c.get("over_50ms") for c in nocap]),
                     "cap_partial_p99_ms": spread([_p99(w, "s4_sim-cap") for w in ws]),
                     "nocap_partial_p99_ms": spread([_p99(w, "s4_sim-nocap") for w in ws])},
                    errors=_errors(ws, ("s4_sim-cap", "s4_sim-nocap")))


def gateway_round(w: Windows, n: int) -> dict[str, Any]:
    """One round's gateway figures at ``n`` streams."""
    gw = w.get(f"s5_{n}_via_gateway", {})
    gp, dp = _p99(w, f"s5_{n}_via_gateway"), _p99(w, f"s5_{n}_direct")
    msgs = gw.get("messages", {})
    stream_s = msgs.get("stream_s") or gw.get("audio_s_sent")
    cpu = gw.get("gateway_cpu_s")
    window_rate = ratio(cpu, stream_s)
    steady_rate = (gw.get("gateway_steady") or {}).get("cpu_s_per_stream_s")
    instr = gw.get("gateway_instructions")
    total_msgs = (msgs.get("sent") or 0) + (msgs.get("received") or 0)
    # a carried stream's cost: the steady part, every stream connected
    gateway_rate = steady_rate if steady_rate is not None else window_rate
    floor_rate = (w.get(f"s5_{n}_floor", {}).get("gateway_steady") or {}).get(
        "cpu_s_per_stream_s")
    return {"via_gateway_p99_ms": gp, "direct_p99_ms": dp,
            "added_p99_ms": None if gp is None or dp is None else gp - dp,
            "gateway_cpu_s_per_stream_s": gateway_rate,
            # bench.floor's bare server under the same streams, and the gateway over it
            "floor_cpu_s_per_stream_s": floor_rate,
            "gateway_over_floor": ratio(gateway_rate, floor_rate),
            "window_cpu_s_per_stream_s": window_rate,
            "setup_cpu_ms_per_session": setup_ms(cpu, steady_rate, stream_s,
                                                 gw.get("live_streams")),
            "sent_per_stream_s": msgs.get("sent_per_stream_s"),
            "received_per_stream_s": msgs.get("received_per_stream_s"),
            "instructions_per_message": ratio(instr, total_msgs),
            "served": None if not gw else bool(_served(w, f"s5_{n}_via_gateway")
                                              and _served(w, f"s5_{n}_direct"))}


def setup_ms(cpu_s: float | None, steady_rate: float | None, stream_s: float | None,
             sessions: int | None) -> float | None:
    """The gateway's CPU ms per session beyond its streaming: connect, admission, worker
    session, close (the window's CPU less the steady rate over its stream-seconds)."""
    if cpu_s is None or steady_rate is None or stream_s is None or not sessions:
        return None
    return 1000 * (cpu_s - steady_rate * stream_s) / sessions


def capacity(ws: list[Windows], n: int) -> dict[str, Any]:
    """The gateway at ``n`` streams over the rounds: median (min, max) of each figure."""
    rounds = [gateway_round(w, n) for w in ws]
    out: dict[str, Any] = {k: spread([r[k] for r in rounds]) for k in rounds[0]
                           if k != "served"} if rounds else {}
    cpu = out.get("gateway_cpu_s_per_stream_s", {}).get("median")
    out["streams_per_core"] = None if not cpu else round(1 / cpu)
    floor = out.get("floor_cpu_s_per_stream_s", {}).get("median")
    out["floor_streams_per_core"] = None if not floor else round(1 / floor)
    out["served"] = [r["served"] for r in rounds]
    return out


def scale_loads(doc: dict[str, Any]) -> list[int]:
    loads = doc["options"].get("scale_streams", [])
    return [int(n) for n in ([loads] if isinstance(loads, int) else loads)]


def upgrade(doc: dict[str, Any]) -> dict[str, Any]:
    """A results.json from before the rounds (one measurement per design) as one round,
    so that ``python -m bench report`` still renders it."""
    r, o = doc["results"], doc["options"]
    if "rounds" in r:
        return doc
    loads = {"s5": o.get("scale_streams"), "s5_mid": o.get("scale_mid_streams"),
             "s5_light": o.get("scale_light_streams")}
    renames = {f"{prefix}_{kind}": f"s5_{n}_{kind}" for prefix, n in loads.items() if n
               for kind in ("via_gateway", "direct")}
    once = ("interference", "run_wall_s")
    windows = {renames.get(k, k): v for k, v in r.items() if k not in once}
    rounds = [{"round": 1, "machine": {}, "windows": windows}]
    loaded = sorted(int(n) for n in loads.values() if n)
    return {**doc, "options": {**o, "scale_streams": loaded, "rounds": 1},
            "results": {k: v for k, v in r.items() if k in once} | {"rounds": rounds}}


def verdict_s5(ws: list[Windows], rule: Rule, loads: list[int],
               target_n: int) -> dict[str, Any]:
    per_load = {n: capacity(ws, n) for n in loads}
    # "added" means something only while the baseline itself keeps the beat: the highest
    # load whose direct p99 (median) is within the red line is where it is quoted.
    held = [n for n in loads if (per_load[n].get("direct_p99_ms", {}).get("median")
                                 or math.inf) <= RED_LINE_MS]
    rounds = [gateway_round(w, target_n) for w in ws]
    added = [r["added_p99_ms"] if (r["direct_p99_ms"] or math.inf) <= RED_LINE_MS else None
             for r in rounds]
    checks = [judge(Check(f"gateway_over_floor at {target_n}", GATEWAY_OVER_FLOOR),
                    [r["gateway_over_floor"] for r in rounds], rule),
              judge(Check(f"added_p99_ms at {target_n}", ADDED_P99_MS), added, rule),
              judge(Check(f"direct_p99_ms at {target_n}", RED_LINE_MS),
                    [r["direct_p99_ms"] for r in rounds], rule),
              judge_flags(f"every stream served at {target_n}", [r["served"] for r in rounds]),
              *protocol_checks(ws, rule)]
    top = max(held) if held else None
    cap = per_load.get(target_n, {})
    return _verdict(f"at {target_n} streams: gateway CPU per stream-second <= "
                    f"{GATEWAY_OVER_FLOOR:g} x the same round's floor (a bare aiohttp server "
                    f"under the same streams; median of the rounds' ratios) and added "
                    f"partial p99 (via gateway minus direct, same round) <= "
                    f"{ADDED_P99_MS:g} ms with direct p99 <= {RED_LINE_MS:g} ms"
                    + ("; each protocol adapter (Deepgram, Wyoming, Realtime) adds <= "
                       f"{ADDED_P99_MS:g} ms p99 over /v1/stream"
                       if any(w.get("s5_protocols") for w in ws) else ""), checks,
                    {"gateway_cpu_s_per_stream_s": spread(
                        [r["gateway_cpu_s_per_stream_s"] for r in rounds]),
                     "floor_cpu_s_per_stream_s": spread(
                        [r["floor_cpu_s_per_stream_s"] for r in rounds]),
                     "streams_per_gateway_core": cap.get("streams_per_core"),
                     "streams_per_core_on_the_floor": cap.get("floor_streams_per_core"),
                     "highest_load_direct_held": top,
                     "added_p99_ms_at_highest_held": None if top is None
                     else per_load[top]["added_p99_ms"]},
                    capacity={str(n): c for n, c in per_load.items()},
                    errors=_errors(ws, tuple(f"s5_{n}_{d}" for n in loads
                                             for d in ("via_gateway", "direct"))))


#: (protocol, figure) pairs judged against ``/v1/stream`` in the same round
PROTOCOL_FIGURES = (("deepgram", "partial_ms"), ("deepgram", "finalize_ms"),
                    ("wyoming", "finalize_ms"), ("realtime", "finalize_ms"))


def protocol_checks(ws: list[Windows], rule: Rule) -> list[dict[str, Any]]:
    """Each adapter's added p99 over ``/v1/stream`` (``bench.protocols``), where a round
    measured it: at most ``ADDED_P99_MS``, and every session finalized."""
    if not any(w.get("s5_protocols") for w in ws):
        return []
    checks = [judge(Check(f"{p} added {fig.removesuffix('_ms')} p99 ms", ADDED_P99_MS),
                    [protocols.added(w["s5_protocols"], p, fig) if w.get("s5_protocols")
                     else None for w in ws], rule)
              for p, fig in PROTOCOL_FIGURES]
    checks.append(judge_flags("every protocol session finalized", [
        None if not w.get("s5_protocols") else
        not any(r["errors"] for r in w["s5_protocols"].values()) for w in ws]))
    return checks


def protocol_table(doc: dict[str, Any]) -> list[str]:
    ws = [w["s5_protocols"] for w in round_windows(doc) if w.get("s5_protocols")]
    if not ws:
        return []
    o = doc["options"]
    lines = [f"Each protocol's adapter against `/v1/stream` in scenario 5's stack (simulated "
             f"workers whose steps cost nothing), one right after the other in each round: "
             f"{o.get('protocol_sessions')} sessions at a time, "
             f"{o.get('protocol_repeats')} times, each streaming "
             f"{o.get('protocol_utterance_s')} s of the live speech at real-time pace, then "
             "ending it the protocol's way (`end`, `CloseStream`, `audio-stop`, "
             "`input_audio_buffer.commit`). Finalize latency: from that end to the final "
             "transcript. Partial latency where the protocol says which audio a partial "
             "covers (`/v1/stream`, Deepgram's interim `start + duration`). Added = the "
             "protocol's p99 minus `/v1/stream`'s in the same round (`bench/protocols.py`).",
             "", "| protocol | finalize p50 / p99 (ms) | added finalize p99 (ms) | "
             "partial p50 / p99 (ms) | added partial p99 (ms) | sessions | errors |",
             "|---|---|---|---|---|---|---|"]
    for p in protocols.PROTOCOLS:
        rs = [w[p] for w in ws if p in w]
        if not rs:
            continue

        def q(fig: str, k: str, rs: list[dict[str, Any]] = rs) -> str:
            return _sp(spread([r[fig][k] for r in rs]))

        def add(fig: str, p: str = p) -> str:
            return "—" if p == "stream" else _sp(spread([protocols.added(w, p, fig)
                                                         for w in ws]))

        partial = ("—" if all(r["partial_ms"]["p99"] is None for r in rs)
                   else f"{q('partial_ms', 'p50')} / {q('partial_ms', 'p99')}")
        lines.append(f"| {'`/v1/stream`' if p == 'stream' else p} | "
                     f"{q('finalize_ms', 'p50')} / {q('finalize_ms', 'p99')} | "
                     f"{add('finalize_ms')} | {partial} | "
                     f"{add('partial_ms') if partial != '—' else '—'} | "
                     f"{sum(r['sessions'] for r in rs)} | "
                     f"{[r['errors'] for r in rs if r['errors']] or '—'} |")
    return lines


def verdict_s6(ws: list[Windows], rule: Rule) -> dict[str, Any]:
    x = [w.get("s6_vad", {}).get("x_realtime") for w in ws]
    return _verdict("VAD >= 300 x real time on one core",
                    [judge(Check("x_realtime", 300.0, at_most=False), x, rule)], {})


def rule_of(options: dict[str, Any]) -> Rule:
    """The verdict rule a run's options name (a results file from before ``unstable_z``
    is judged by today's default)."""
    return Rule(margin=float(options.get("unstable_margin", UNSTABLE_MARGIN)),
                z=float(options.get("unstable_z", UNSTABLE_Z)))


def verdicts(doc: dict[str, Any]) -> dict[str, Any]:
    ws = round_windows(doc)
    o = doc["options"]
    rule = rule_of(o)
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "s1": lambda: verdict_s1(ws, rule, live_limit_ms(o)),
        "s2": lambda: verdict_s2(ws, rule, live_limit_ms(o)),
        "s3": lambda: verdict_s3(ws, rule, engine_of(o)), "s4": lambda: verdict_s4(ws, rule),
        "s5": lambda: verdict_s5(ws, rule, scale_loads(doc),
                                 int(o.get("scale_target_streams", 200))),
        "s6": lambda: verdict_s6(ws, rule)}
    return {k: f() for k, f in checks.items() if k in o["scenarios"]}


# --- BENCHMARKS.md -----------------------------------------------------------------

METHOD = (
    "**Method.** A run is `--rounds` rounds (default 3){s1_rounds}. A round runs every design of "
    "every chosen scenario once, one after another (scenario 1: `split` alone, `split` "
    "under the flood, `mixed` under the flood; 2: `split-nocap` and `split` with the "
    "dumps; 3: the raw engine's ceiling, then the flood in `split`; 4: cap, no cap; 5: at "
    "each load through the gateway, then direct, then on the floor; 6: the VAD), so the "
    "two sides of a comparison run seconds apart, in the same state of the machine, and the rounds "
    "sample its moments. Each figure a target names is taken per round (a ratio from "
    "that round's own pair) and reported as the median of the rounds with the min and "
    "max beside it. A check is **met** when every round meets its limit and **missed** "
    "when no round does. {disagree} A yes/no check (every stream served) that some "
    "rounds pass and others fail is **unstable**. A scenario is missed if any of its checks "
    "is missed, else unstable if any is unstable, else met; a round without the figure "
    "(no partial arrived) is left out of that check. Every round records the "
    "machine's speed: a fixed pure-Python loop (`for i in range({loop:_}): s += i * i`, "
    "seconds, higher is slower) timed before and after each part of the round, and the "
    "CPU time the hypervisor stole over it (`/proc/stat`), shown in the Rounds table "
    "beside that round's figures; every round's raw figures are in `results.json` "
    "(`results.rounds`).")


def scenario_rounds(doc: dict[str, Any]) -> tuple[int, int, int]:
    """(rounds, rounds with scenario 1, rounds with any other scenario); a round from
    before ``s1_rounds`` ran every chosen scenario."""
    chosen = doc.get("options", {}).get("scenarios", ())
    ran = [set(rnd.get("scenarios", chosen)) for rnd in doc["results"].get("rounds", [])]
    return len(ran), sum("s1" in r for r in ran), sum(bool(r - {"s1"}) for r in ran)


def s1_ran_longer(doc: dict[str, Any]) -> bool:
    """Scenario 1 ran in more rounds than the others (``--s1-rounds``)."""
    _, s1, others = scenario_rounds(doc)
    return s1 > others > 0


def s1_rounds_rule(doc: dict[str, Any]) -> str:
    """The method's words on scenario 1's own rounds, for a run that had them."""
    if not s1_ran_longer(doc):
        return ""
    return (", and scenario 1 runs in `--s1-rounds` (default 5: its ratio of two p99s of 4 "
            "streams is the noisiest figure, so the rounds past `--rounds` run it alone; "
            "each scenario is judged on the rounds it ran in)")


def rounds_text(doc: dict[str, Any]) -> str:
    """How many rounds each scenario ran in."""
    total, s1, others = scenario_rounds(doc)
    return f"{others} rounds, scenario 1 in {s1}" if s1_ran_longer(doc) else f"{total} rounds"


def placement(doc: dict[str, Any]) -> str:
    """Where the load clients and scenario 5's processes ran: pinned since
    ``s1_duration_s`` came in (in a results file from before it they float over every
    CPU); scenario 5's load clients with its workers only where its stack records a
    ``load_cpus`` (the run of 7 December that pinned them,
    ``results-epyc-dec7-full-c-d5c20dc.json``); else not pinned."""
    o = doc["options"]
    if "s1_duration_s" not in o:
        return "the load clients and scenario 5's gateway and workers not pinned"
    scale: dict[str, Any] = next(
        (s for s in doc.get("stacks", []) if s["design"] == "sim-free"), {})
    load = scale.get("load_cpus")
    return (f"the load clients of scenarios 1-3 on CPU {o['rt_cpus']}; for scenario 5 the "
            f"gateway, the floor and redis on CPU {o['rt_cpus']}, both workers on CPU "
            f"{o['batch_cpus']} and the load clients "
            + (f"on CPU {load} with them" if load else "not pinned"))


def disagreement_rule(rule: Rule) -> str:
    """The method paragraph's sentences on rounds that disagree, for this rule."""
    if math.isinf(rule.margin):
        return ("When the rounds disagree, the check is **unstable** "
                "(`--unstable-margin inf`).")
    margin = (f"When the rounds disagree, the median decides if it lies beyond the limit "
              f"by more than a margin of {rule.margin:.0%} of the limit (for a share that "
              f"must reach L, {rule.margin:.0%} of 1 − L; `--unstable-margin`)")
    if rule.z <= 0:
        return f"{margin}: met or missed; within that margin the check is **unstable**."
    return (f"{margin} and by more than {rule.z:g} standard errors of the median "
            f"(`--unstable-z`; the error estimated from the rounds' own spread, {MAD_TO_SIGMA:g} × "
            f"their median absolute deviation × √(π/2) ÷ √rounds): met or missed; "
            f"nearer the limit than either, the check is **unstable**. The second "
            f"distance keeps a verdict from resting on rounds that spread wider than the "
            f"margin: on a noisy machine the next run's median can land on the other side "
            f"of the limit, and a verdict the next run contradicts is not one.")


def _f(v: Any, digits: int = 1) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _g(v: Any) -> str:
    """A figure: shares and other small floats with 4 significant digits (0.9996 is not
    1), up to 10 with 3, others with 1 decimal."""
    if isinstance(v, float) and not isinstance(v, bool):
        return f"{v:.4g}" if abs(v) < 1 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return _f(v)


def _sp(s: dict[str, Any] | None) -> str:
    """median (min–max) of a spread."""
    if not s or s.get("median") is None:
        return "—"
    if len([v for v in s["rounds"] if v is not None]) < 2:
        return _g(s["median"])
    return f"{_g(s['median'])} ({_g(s['min'])}–{_g(s['max'])})"


def _verdict_word(v: str) -> str:
    return f"**{v}**" if v != "not measured" else v


def _check_text(c: dict[str, Any]) -> str:
    if "median" in c:
        return (f"{c['check']}: {_sp(c)}, {c['rounds_passed']}/{c['rounds_measured']} "
                f"rounds → {c['verdict']}")
    return f"{c['check']}: {c['rounds_passed']}/{c['rounds_measured']} rounds → {c['verdict']}"


def verdict_table(doc: dict[str, Any]) -> list[str]:
    lines = ["| scenario | target | checks: median (min–max) over the rounds | other figures "
             "| result |", "|---|---|---|---|---|"]
    for key, ver in doc["verdicts"].items():
        checks = "<br>".join(_check_text(c) for c in ver["checks"])
        figures = ", ".join(f"{k} = {_sp(x) if isinstance(x, dict) else _g(x)}"
                            for k, x in ver["figures"].items())
        if ver.get("errors"):
            figures += f"; errors: {ver['errors']}"
        lines.append(f"| {key[1:]} | {ver['target']} | {checks} | {figures or '—'} | "
                     f"{_verdict_word(ver['verdict'])} |")
    return lines


def capacity_table(doc: dict[str, Any]) -> list[str]:
    cap = doc["verdicts"].get("s5", {}).get("capacity")
    if not cap:
        return []
    lines = ["| streams | gateway CPU s per stream-s (steady) | streams per gateway core | "
             "floor: bare aiohttp server, same streams | gateway ÷ floor | "
             "whole window, setup included | setup CPU ms per session | client → "
             "gateway msgs per stream-s | gateway → client msgs per stream-s | p99 via "
             "gateway (ms) | p99 direct (ms) | added p99 (ms) | instructions per message |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, c in cap.items():
        lines.append(f"| {n} | {_sp(c['gateway_cpu_s_per_stream_s'])} | "
                     f"{_f(c['streams_per_core'])} | "
                     f"{_sp(c.get('floor_cpu_s_per_stream_s', {}))} | "
                     f"{_sp(c.get('gateway_over_floor', {}))} | "
                     f"{_sp(c.get('window_cpu_s_per_stream_s', {}))} | "
                     f"{_sp(c.get('setup_cpu_ms_per_session', {}))} | "
                     f"{_sp(c['sent_per_stream_s'])} | "
                     f"{_sp(c['received_per_stream_s'])} | {_sp(c['via_gateway_p99_ms'])} | "
                     f"{_sp(c['direct_p99_ms'])} | {_sp(c['added_p99_ms'])} | "
                     f"{_sp(c['instructions_per_message'])} |")
    return lines


def perf_line(doc: dict[str, Any]) -> str:
    perf = doc["results"].get("perf")
    if not perf:
        return ""
    if perf.get("supported"):
        return ("Instructions per message: `perf stat -e instructions -p <gateway>` over "
                "each through-the-gateway window, divided by the messages the clients "
                "sent and received; unlike CPU seconds it does not change with the "
                "machine's speed.")
    return f"Instructions per message: **unsupported** on this machine: {perf['reason']}."


def _round_figures(w: Windows, part: str, doc: dict[str, Any]) -> str:
    """The figures of one part of a round, for the Rounds table."""
    f: list[tuple[str, Any]] = []
    if part in ("pocketsphinx", "whisper"):
        a, s, m = _p99(w, "s1_alone"), _p99(w, "s1_split"), _p99_any(w, "s1_mixed")
        ceiling = w.get("ceiling", {})
        share = ratio(w.get("s3_split_batch", {}).get("audio_s_per_wall_s"),
                      (ceiling.get("faster_whisper") or ceiling).get("audio_s_per_wall_s"))
        f = [("1 alone / split / mixed p99 ms", f"{_g(a)} / {_g(s)} / {_g(m)}"),
             ("split ÷ alone", ratio(s, a)),
             ("2 cap / nocap p99 ms", f"{_g(_p99(w, 's2_split'))} / "
                                      f"{_g(_p99(w, 's2_split_nocap'))}"),
             ("3 share of ceiling", share)]
    elif part == "simulated":
        f = [("4 cap / nocap share ≤ 50 ms",
              f"{_g(_steps(w.get('s4_sim-cap', {})).get('share_le_50ms'))} / "
              f"{_g(_steps(w.get('s4_sim-nocap', {})).get('share_le_50ms'))}")]
    elif part == "gateway":
        for n in scale_loads(doc):
            g = gateway_round(w, n)
            f.append((f"5 @{n}: CPU s/stream-s, added p99 ms",
                      f"{_g(g['gateway_cpu_s_per_stream_s'])}, {_g(g['added_p99_ms'])}"))
    elif part == "vad":
        f = [("6 × real time", w.get("s6_vad", {}).get("x_realtime"))]
    return "; ".join(f"{k}: {_g(v)}" for k, v in f if v not in (None, "— / —", "— / — / —"))


def rounds_table(doc: dict[str, Any]) -> list[str]:
    rounds = [rnd for rnd in doc["results"].get("rounds", []) if rnd["machine"]]
    if not rounds:
        return []
    lines = ["| round | part | probe before / after (s) | steal | CPUs busy | wall (s) | "
             "figures |", "|---|---|---|---|---|---|---|"]
    for rnd in rounds:
        for part, mach in rnd["machine"].items():
            before, after = mach["probe_s"]
            lines.append(f"| {rnd['round']} | {part} | {before:.2f} / {after:.2f} | "
                         f"{100 * mach['steal_share']:.1f}% ({mach['steal_s']:.1f} s) | "
                         f"{100 * mach['busy_share']:.0f}% | {mach['wall_s']:.0f} | "
                         f"{_round_figures(rnd['windows'], part, doc)} |")
    return lines


def design_rows(doc: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(results key, scenario, design, load) of every window kind in the run."""
    rows = [
        ("s1_alone", "1", "split", "streams alone"),
        ("s1_split", "1", "split", "streams + batch flood"),
        ("s1_mixed", "1", "mixed", "streams + batch flood"),
        ("s2_split", "2", "split", "streams + 10 s dumps"),
        ("s2_split_nocap", "2", "split-nocap", "streams + 10 s dumps"),
        ("s4_sim-cap", "4", "split (simulated)", "streams + long prefills"),
        ("s4_sim-nocap", "4", "split-nocap (simulated)", "streams + long prefills"),
    ]
    for n in scale_loads(doc):
        rows += [(f"s5_{n}_direct", "5", "direct to workers (simulated, free)", "streams"),
                 (f"s5_{n}_via_gateway", "5", "through the gateway (simulated, free)",
                  "streams")]
    return rows


def latency_table(doc: dict[str, Any]) -> list[str]:
    ws = round_windows(doc)
    lines = [
        "| scen. | design | load | live streams | partial p50 / p95 / max (ms), median "
        "| partial p99 (ms), median (min–max) | first partial p50 (ms) | final p99 (ms) "
        "| step p99 (ms), share ≤ 50 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, scen, design, load in design_rows(doc):
        res = [w[key] for w in ws if w.get(key)]
        if not res:
            continue

        def med(part: str, q: str, rs: list[dict[str, Any]] = res) -> str:
            return _sp(spread([r[part][q] for r in rs]))

        p = [_g(spread([r["partial_ms"][q] for r in res])["median"])
             for q in ("p50", "p95", "max")]
        steps = [_steps(r) for r in res]
        step = (f"{_sp(spread([st.get('p99_ms') for st in steps]))}, "
                f"{_sp(spread([st.get('share_le_50ms') for st in steps]))}"
                if any(steps) else "—")
        errors = [r["errors"] for r in res if r["errors"]]
        lines.append(
            f"| {scen} | {design} | {load} | {res[0]['live_streams']} | {' / '.join(p)} | "
            f"{med('partial_ms', 'p99')} | {med('first_partial_ms', 'p50')} | "
            f"{med('final_ms', 'p99')} | {step} | {errors or '—'} |")
    return lines


def batch_lines(doc: dict[str, Any]) -> list[str]:
    r = doc["results"]
    ws = round_windows(doc)
    out = []
    ceil = [w["ceiling"] for w in ws if w.get("ceiling")]
    if ceil and "faster_whisper" in ceil[0]:
        out += whisper_ceiling_lines(ceil)
    elif ceil:
        out.append(f"- Raw engine ceiling (pocketsphinx Decoder, same VAD segments and "
                   f"decoder config, pinned to CPU {ceil[0]['cpus']}, once per round): "
                   f"{ceil[0]['audio_s']} s of audio, **"
                   f"{_sp(spread([c['audio_s_per_wall_s'] for c in ceil]))} audio s per "
                   f"wall s**.")
    inter = r.get("interference")
    if inter:
        out.append(f"- Same chip, service aside (once, before the rounds): pocketsphinx's "
                   f"stream decoder (100 ms chunks) on CPU {inter['rt_alone']['cpus']} takes "
                   f"{inter['rt_alone']['wall_s_per_audio_s']} s per audio s with the other "
                   f"CPU idle and {inter['rt_with_batch_busy']['wall_s_per_audio_s']} s "
                   f"while the batch engine decodes on the other CPU (x{inter['slowdown']}); "
                   f"{inter.get('rt_with_spin_busy', {}).get('wall_s_per_audio_s')} s while "
                   f"a plain interpreter loop with almost no memory traffic spins there "
                   f"(x{inter.get('spin_slowdown')}).")
    s3 = [w["s3_split_batch"] for w in ws if w.get("s3_split_batch")]
    if s3:
        wer = [b.get("wer") for b in s3]
        # since a68cfbf: the window's rate and the WER of the first upload to finish
        # (taken to the window's end before 1a73a4d); before, every upload's, waited for
        upto = ("the last progress write before its end" if any("progress_age_s" in b
                                                             for b in s3) else "its end")
        what = (f"audio s per wall s over the `split` flood window (the audio done by "
                f"{upto}, over the time since the first upload started), WER of the "
                "first upload to finish"
                if s3[0].get("rate") == "window" else
                f"{s3[0].get('jobs')} jobs per round, completed per round "
                f"{[b.get('completed') for b in s3]}, audio s per wall s between the first "
                "start and the last finish")
        out.append(f"- `split` batch lane, {what}: **"
                   f"{_sp(spread([b.get('audio_s_per_wall_s') for b in s3]))}**"
                   + (f", WER {_sp(spread(wer))}" if any(v is not None for v in wer) else "")
                   + ".")
    for key, name in (("s1_split", "split"), ("s1_mixed", "mixed")):
        b = [w[key]["batch_during_window"] for w in ws
             if w.get(key, {}).get("batch_during_window")]
        if b:
            out.append(f"- Batch progress during the `{name}` flood window (progress x "
                       f"audio / time since the first job started): "
                       f"{_sp(spread([x.get('audio_s_per_wall_s') for x in b]))} audio s "
                       f"per wall s.")
    return out


def whisper_ceiling_lines(ceil: list[dict[str, Any]]) -> list[str]:
    """Scenario 3's yardsticks on Whisper (``bench.whisper_batch_vs_faster``)."""
    c = ceil[0]
    fw = [x["faster_whisper"] for x in ceil]
    raw = [x["lanegate"] for x in ceil]
    return [f"- On one flood upload ({c['audio_s']} s, pinned to CPU {c['cpus']}, Whisper "
            f"{c['model']} {c['compute_type']}, {c['threads']} thread(s), batch size "
            f"{c['batch_size']}, once per round): faster-whisper's "
            f"`BatchedInferencePipeline` **{_sp(spread([f['audio_s_per_wall_s'] for f in fw]))}"
            f" audio s per wall s**, WER {_sp(spread([f['wer'] for f in fw]))}, "
            f"{_sp(spread([f['words'] for f in fw]))} words; lanegate's own batch call "
            f"outside the service (`WhisperEngine.transcribe_batch` on its decode windows) "
            f"{_sp(spread([r['audio_s_per_wall_s'] for r in raw]))} audio s per wall s, "
            f"WER {_sp(spread([r['wer'] for r in raw]))}, "
            f"{_sp(spread([r['words'] for r in raw]))} words."]


def live_speech(o: dict[str, Any]) -> str:
    wav = o.get("wav")
    if not wav:
        return " (espeak-ng sentences as the live speech)"
    return f" (live streams: `{Path(str(wav)).name}`, a human recording, at staggered offsets)"


def trade_section(doc: dict[str, Any]) -> list[str]:
    """The opening section: scenario 1's two designs on the same CPUs, both sides."""
    table = trade_table(doc)
    if not table:
        return []
    o = doc["options"]
    n = o.get("streams")
    same = ("each design for "
            f"{o.get('s1_duration_s', o['duration_s']):.0f} s in every round, one right "
            "after the other. `mixed` has a mixed worker in each place where `split` has a "
            "worker (`lanegate up --lanes mixed` places them the same way): the same "
            "hardware, used two ways." if "engine" in o else
            "`split` for the longer window, `mixed` for the shorter one, in every round. "
            "This run is from before `mixed` had a worker in each of split's places: its "
            "one mixed worker had one CPU where split's two workers had two, so `mixed` "
            "lost on hardware as well as on scheduling.")
    return ["## The trade on the default engine: `split` and `mixed` on the same CPUs"
            if engine_of(o) == "whisper" else
            "## The trade: `split` and `mixed` on the same CPUs", "",
            f"{engine_of(o).capitalize()}; {n} live streams{live_speech(o)} beside "
            f"{o['flood_jobs']} uploads of {o['flood_job_s']:.0f} s, {same}", "", *table, "",
            trade_sentence(doc), ""]


def trade_table(doc: dict[str, Any]) -> list[str]:
    """Both sides of the trade from the same rounds: split and mixed on the same CPUs,
    each under the same flood for the same window."""
    ws = round_windows(doc)
    rows = []
    for key, design in (("s1_split", "split"), ("s1_mixed", "mixed")):
        workers = worker_placement(doc, design)
        res = [w[key] for w in ws if w.get(key)]
        if not res:
            continue
        stalls = [stalled_streams(w, key) for w in ws if w.get(key)]
        stall = sum(x or 0 for x in stalls)
        lengths = sorted({r["stall_ms"] for r in res if r.get("stall_ms")})
        stall_note = (f" (each counted as {'/'.join(_g(v) for v in lengths)} ms)"
                      if lengths else "")
        dry = sum(ran_dry(w, key) for w in ws if w.get(key))
        dry_note = (f" (the uploads ran out before the window ended in {dry} of {len(res)} "
                    "rounds)" if dry else "")
        rows.append(
            f"| `{design}` | {workers} | {_sp(spread([_p99(w, key) for w in ws]))} | "
            f"{stall} of {sum(r['live_streams'] for r in res)}{stall_note} | "
            f"{_sp(spread([partials_per_stream_s(w, key) for w in ws]))} | "
            f"{_sp(spread([longest_wait(w, key) for w in ws]))} | "
            f"{_sp(spread([batch_rate(w, key) for w in ws]))}{dry_note} |")
    if not rows:
        return []
    return ["| design | placement | live partial p99 (ms), median (min–max) | streams "
            "stalled (no partial in the window), all rounds | partials per stream-second | "
            "longest wait for a partial, worst stream (ms) | batch audio s per wall s |",
            "|---|---|---|---|---|---|---|", *rows]


def worker_placement(doc: dict[str, Any], design: str) -> str:
    """Where the design's workers ran, from the recorded stacks: "realtime worker on
    CPU 0, batch worker on CPU 1"."""
    for stack in doc.get("stacks", []):
        if stack["design"] != design:
            continue
        out = []
        for proc in stack["processes"]:
            if not proc["name"].startswith("worker-"):
                continue
            lane = proc["name"].split("-")[1]
            argv = proc["argv"]
            cpus = argv[2] if argv[:2] == ["taskset", "-c"] else "any CPU"
            out.append(f"{lane} worker on CPU {cpus}")
        return ", ".join(out)
    return "—"


def trade_sentence(doc: dict[str, Any]) -> str:
    """What the table says: split wins on both sides, or trades one for the other.

    Live latency is judged on the partials' p99 and on how the streams were served:
    a design whose streams get under half the other's partials per stream-second, or
    wait longer for one, is not ahead on live latency however quick the few partials
    it sends are (a stalled stream is already in its p99 at the window's length)."""
    ws = round_windows(doc)

    def med(values: list[float | None]) -> float | None:
        got = spread(values)["median"]
        return None if got is None else float(got)

    def fig(f: Callable[[Windows, str], float | None]) -> tuple[float | None, float | None]:
        return med([f(w, "s1_split") for w in ws]), med([f(w, "s1_mixed") for w in ws])

    (sp, mp), (sb, mb) = fig(_p99), fig(batch_rate)
    (sr, mr), (sg, mg) = fig(partials_per_stream_s), fig(longest_wait)
    if sp is None or mp is None or sb is None or mb is None:
        return ""
    sbs, mbs = ([v for w in ws if (v := batch_rate(w, k)) is not None]
                for k in ("s1_split", "s1_mixed"))
    # batch figures whose rounds overlap are one figure: which median is higher is noise
    same_batch = min(sbs) <= max(mbs) and min(mbs) <= max(sbs)
    stalls = sum(stalled_streams(w, "s1_mixed") or 0 for w in ws)
    notes = []
    dry = [w[k]["batch_during_window"] for w in ws for k in ("s1_split", "s1_mixed")
           if ran_dry(w, k)]
    # before ran_dry_s, a dry flood's figure ran to the window's end: the flood's size
    # over the window, the same for any lane fast enough to finish it
    unread = any("ran_dry_s" not in b for b in dry)
    if dry and not unread:
        notes.append("The uploads ran out before the window ended in some rounds (the "
                     "table says which design's): those batch figures are taken to the last "
                     "upload's finish, and a longer flood (`--flood-job-s`) would keep the "
                     "live streams beside it to the window's end.")
    if stalls:
        notes.append(f"In `mixed`, {stalls} stream-window(s) got no partial at all: each "
                     "is counted at the window's length, its worst figure, not left out.")
    few = sr is not None and mr is not None and mr < sr / 2  # under half split's partials
    starved = few or (sg is not None and mg is not None and mg > sg)
    live_split = sp <= mp or starved
    if mp < sp and starved:
        wait = (f" and waited up to {_g(mg)} ms for one (split: {_g(sg)} ms)"
                if sg is not None and mg is not None and mg > sg else "")
        sent = "the few partials" if few else f"the partials ({_g(mr)} per stream-second)"
        notes.append(f"`mixed`'s lower p99 ({_g(mp)} against {_g(sp)} ms) is over {sent} "
                     f"it sent{wait}.")
    tail = "".join(" " + n for n in notes)
    live = (f"live partial p99 {_g(sp)} ms against {_g(mp)} ms" if sp <= mp else
            f"its live streams got {_g(sr)} partials per stream-second against {_g(mr)}")
    if unread:
        side = ("ahead on live latency here" if live_split else
                "behind on live latency here")
        return (f"`split` is {side} ({live}); the batch figures cannot say which design "
                "does more: every upload had finished before the window ended in some "
                "rounds (the table says which design's), so those figures are the flood's "
                "size over the window, the same for any lane fast enough to finish it." + tail)
    if live_split and same_batch:
        return (f"`split` is ahead on live latency here ({live}) at the same batch "
                f"throughput within the rounds' spread ({_g(sb)} ({_g(min(sbs))}–"
                f"{_g(max(sbs))}) against {_g(mb)} ({_g(min(mbs))}–{_g(max(mbs))}) batch "
                "audio s per wall s): the second CPU on which `mixed` also decodes uploads "
                "bought no batch throughput the rounds can tell apart, and its live "
                "streams paid for the batch calls they waited out." + tail)
    if live_split and sb >= mb:
        return (f"`split` wins on both sides here: {live}, and {_g(sb)} batch audio s per "
                f"wall s against {_g(mb)}. Why both: a mixed worker decodes a whole batch of "
                "upload segments in its one loop with no cap, so a live stream waits out "
                "every batch call, and the live steps it runs in between take loop time "
                "from the batch; the split batch worker only decodes, and the realtime CPU "
                "only serves the live streams." + tail)
    if live_split:
        return (f"A trade: `split` is ahead on live latency ({live}) and gives up "
                f"{_g(100 * (1 - sb / mb))} % of batch throughput ({_g(sb)} against "
                f"{_g(mb)} audio s per wall s): its realtime CPU idles between live steps "
                "instead of decoding uploads, where `mixed` decodes them on both CPUs." + tail)
    return (f"`mixed` is ahead on live latency here ({_g(mp)} against {_g(sp)} ms, "
            f"{_g(mr)} against {_g(sr)} partials per stream-second) and "
            f"{'ahead' if mb > sb else 'behind'} on batch ({_g(mb)} against {_g(sb)} audio s "
            "per wall s)." + tail)


def cap_lines(doc: dict[str, Any]) -> list[str]:
    """What the step cap does for this run's engine on a CPU, and on a GPU."""
    v = doc.get("verdicts", {}).get("s2")
    if not v:
        return []
    f = v["figures"]
    capped, uncapped = v["checks"][0], f["split_nocap_p99_ms"]
    steps = (f"step p99 {_sp(f.get('split_step_p99_ms'))} ms capped, "
             f"{_sp(f.get('split_nocap_step_p99_ms'))} ms uncapped; live partial p99 "
             f"{_sp(capped)} ms capped, {_sp(uncapped)} ms uncapped")
    if engine_of(doc["options"]) != "whisper":
        return [f"The cap on pocketsphinx ({steps}): an uncapped step decodes the whole "
                "10 s dump in one call and every live stream waits for it; capped, the "
                "dump is digested a chunk per step."]
    return [f"**What the cap does for Whisper on a CPU, and on a GPU.** Here ({steps}). "
            "Whisper is not incremental: each realtime step re-decodes every stepped "
            "session's whole current segment. The cap limits how much *new* audio a session "
            "adds per step, but on a CPU a step's cost is that session's re-decode, so a "
            "capped step is only as small as one session's decode, and that is bounded by "
            "the segment's length (`max_window_s`, 25 s; the committed prefix keeps the "
            "generated tail short), not by the budget: `split` and `split-nocap` show much "
            "the same step histogram on a CPU. On a GPU the step decodes many sessions' "
            "segments in one batched call padded to the longest; there an uncapped 25 s "
            "segment mixed into the live batch makes every live session pay its encoder "
            "time, and the budget keeps it out of the live batch. `python -m bench gpu` "
            "measures that (capped against uncapped) on the day a GPU is lent; its section "
            "below holds the figures when it has run."]


def markdown(doc: dict[str, Any], notes: str = "", results_dir: str = "bench/results") -> str:
    """BENCHMARKS.md; ``results_dir`` is where results.json and the plots are, relative
    to the Markdown file."""
    rd = results_dir
    m, o, r = doc["machine"], doc["options"], doc["results"]
    pk = m["packages"]
    ws = round_windows(doc)
    parts = [
        "# Benchmarks",
        "",
        f"Generated by `{doc.get('command', 'python -m bench run')}` (how it works: the "
        "Benchmark section of `docs/ARCHITECTURE.md`); "
        f"every figure below is in [`{rd}/results.json`]({rd}/results.json) "
        "with the machine, the options and the exact command line and `LANEGATE_*` "
        "environment of every process.",
        "",
        *trade_section(doc),
        f"Machine: {m['nproc']} × {m['cpu_model']}, {m['mem_gib']} GiB, Linux {m['kernel']}, "
        f"Python {m['python']}, pocketsphinx {pk.get('pocketsphinx')}, "
        + (f"faster-whisper {pk.get('faster-whisper')}, ctranslate2 {pk.get('ctranslate2')}, "
           if pk.get("faster-whisper") else "") + f"aiohttp "
        f"{pk.get('aiohttp')}, {m['redis_server'].split(' sha')[0]}. Run {m['date_utc']}, "
        f"commit `{m['git_commit'][:10]}`, load average at start {m['load_avg_at_start'][0]:.2f}, "
        f"whole run {r.get('run_wall_s')} s.",
        "",
        f"{rounds_text(doc)}. Windows: {o['duration_s']:.0f} s per {engine_of(o)} window "
        f"({o['streams']} live streams; scenario 1's alone and split windows "
        f"{o.get('s1_duration_s', o['duration_s']):.0f} s), {o['sim_duration_s']:.0f} s with "
        f"{o['sim_streams']} simulated streams, {o['scale_duration_s']:.0f} s at each of "
        f"{', '.join(str(n) for n in scale_loads(doc))} streams for the gateway. Batch "
        f"flood: {o['flood_jobs']} async uploads of {o['flood_job_s']:.0f} s each. Realtime "
        f"worker on CPU {o['rt_cpus']}, batch worker on CPU {o['batch_cpus']}; "
        f"{placement(doc)}. Engines: "
        f"`{engine_of(o)}` for scenarios 1-3{live_speech(o)}, `simulated` for 4-5, named in "
        "every stack's `LANEGATE_ENGINE`.",
        "",
        METHOD.format(disagree=disagreement_rule(rule_of(o)), s1_rounds=s1_rounds_rule(doc),
                      loop=PROBE_LOOP),
        "",
        "## Targets",
        "",
        *verdict_table(doc),
        "",
    ]
    if capacity_table(doc):
        parts += ["## Gateway capacity", "",
                  "Gateway CPU seconds (utime + stime from `/proc/<pid>/stat`) per "
                  "stream-second: the headline is a carried stream's, over the steady part "
                  "of each through-the-gateway window (sampled from 1 s after the last "
                  "stream's start to 0.5 s before the first one's end, every stream "
                  "connected and sending); the whole window's figure includes every "
                  "session's connect, admission and close, and the setup CPU per session "
                  "is the whole window's CPU less the steady rate over its stream-seconds, "
                  "per session (sessions last only the window here, minutes in "
                  "production). Messages counted by "
                  "the load clients (the gateway forwards each: audio frames and `end` one "
                  "way, events the other; it keeps no message counters of its own). "
                  "Streams per gateway core = 1 / the median CPU seconds per stream-second. "
                  "Added p99 = p99 through the gateway minus p99 direct to the workers in "
                  "the same round. The floor is `bench/floor.py`: a bare aiohttp "
                  "WebSocket server on the same loop (uvloop) that only receives the same "
                  "streams' frames and sends events at the gateway's rate (2.2 per "
                  "stream-second), relaying nothing, measured the same way in the same "
                  "rounds: what an aiohttp gateway cannot go below at these frame sizes. "
                  "The gateway's cost over it is the relay's own.", "",
                  *capacity_table(doc), "", perf_line(doc), ""]
    if protocol_table(doc):
        parts += ["## Protocol adapters over `/v1/stream`", "", *protocol_table(doc), ""]
    if rounds_table(doc):
        parts += ["## Rounds", "",
                  "The machine's speed beside each round's figures: the probe loop's seconds "
                  "before and after the part (higher is slower), the CPU time stolen by the "
                  "hypervisor over it, and the CPUs' busy share.", "",
                  *rounds_table(doc), ""]
    parts += ["## Latency per design", "",
              "Client-side: partial latency is the arrival time of a partial minus the send "
              "time of the frame holding its `audio_end_ms`; first partial is the first "
              "non-empty partial minus the first frame's send time; final latency is the "
              "same as partial latency for finals. Steps: the workers' "
              "`lanegate_step_duration_seconds` histograms over the window, scraped from "
              "the `/metrics` of the workers listed in the Redis registry (quantiles "
              "interpolated inside Prometheus buckets). Each figure is the median over the "
              "rounds; the p99 columns give the min and max of the rounds.", "",
              *latency_table(doc), "", *cap_lines(doc), "",
              "## Batch throughput", "", *batch_lines(doc), ""]
    vads = [w["s6_vad"] for w in ws if w.get("s6_vad", {}).get("x_realtime")]
    if vads:
        parts += ["## VAD", "", f"`bench.vad_speed.measure_vad_speed({o['vad_seconds']:.0f})` "
                  f"pinned to CPU {vads[0].get('cpus')}, once per round: **"
                  f"{_sp(spread([v['x_realtime'] for v in vads]))} × real time**.", ""]
    parts += ["## Plots", "",
              f"![each round's figure against its limit]({rd}/rounds.png)", "",
              f"![partial latency CDF per design, every round]({rd}/latency_cdf.png)", "",
              f"![step durations per design]({rd}/step_histogram.png)", "",
              f"![worst partial latency over time]({rd}/timeline.png)", ""]
    if notes:
        parts += [notes.strip(), ""]
    return "\n".join(parts)


def readme_summary(doc: dict[str, Any]) -> str:
    """The README's benchmark sentence: each verdict with its medians (min–max)."""
    v = doc["verdicts"]

    def check(key: str, i: int) -> str:
        return _sp(v[key]["checks"][i])

    parts = []
    if "s1" in v:
        f = v["s1"]["figures"]
        parts.append(f"1 {v['s1']['verdict']}: under a batch flood `split` kept live streams "
                     f"at partial p99 {check('s1', 1)} ms, {check('s1', 0)} × alone "
                     f"({_sp(f['alone_p99_ms'])} ms); `mixed` reached "
                     f"{_sp(f['mixed_p99_ms'])} ms")
    if "s2" in v:
        parts.append(f"2 {v['s2']['verdict']}: the cap kept them at {check('s2', 0)} ms while "
                     f"a client dumped 10 s (no cap: "
                     f"{_sp(v['s2']['figures']['split_nocap_p99_ms'])} ms)")
    if "s3" in v:
        yardstick = ("faster-whisper's BatchedInferencePipeline" if "batched_pipeline_wer"
                     in v["s3"]["figures"] else "the raw engine")
        parts.append(f"3 {v['s3']['verdict']}: the batch lane ran at {check('s3', 0)} of "
                     f"{yardstick}")
    if "s4" in v:
        parts.append(f"4 {v['s4']['verdict']}: with the cap a share of {check('s4', 0)} of "
                     "steps took at most 50 ms")
    if "s5" in v:
        n = doc["options"].get("scale_target_streams", 200)
        cap = v["s5"].get("capacity", {}).get(str(n), {})
        parts.append(f"5 {v['s5']['verdict']}: at {n} streams the gateway used "
                     f"{check('s5', 0)} × the CPU of a bare aiohttp server under the same "
                     f"streams ({_sp(cap.get('gateway_cpu_s_per_stream_s'))} against "
                     f"{_sp(cap.get('floor_cpu_s_per_stream_s'))} CPU s per stream-second: "
                     f"{_f(cap.get('streams_per_core'))} streams per gateway core, "
                     f"{_f(cap.get('floor_streams_per_core'))} on the floor) and added "
                     f"{check('s5', 1)} ms at p99")
    if "s6" in v:
        parts.append(f"6 {v['s6']['verdict']}: the VAD ran at {check('s6', 0)} × real time")
    rounds = len(round_windows(doc))
    return f"Medians of {rounds} rounds (min–max): " + "; ".join(parts) + "."
