"""The machine description, the verdict on each target, and BENCHMARKS.md."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("aiohttp", "redis", "pocketsphinx", "webrtcvad-wheels", "prometheus-client",
            "numpy", "soxr", "av", "structlog", "matplotlib", "lanegate")
RED_LINE_MS = 300.0


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


def _p99(res: dict[str, Any], key: str) -> float | None:
    part = res.get(key, {}).get("partial_ms", {})
    v = part.get("p99")
    return None if v is None else float(v)


def _served_all(res: dict[str, Any]) -> bool:
    """Every stream of the window was served to its end without an error."""
    return bool(res) and not res.get("errors")


def _verdict(target: str, met: bool | None, **figures: Any) -> dict[str, Any]:
    return {"target": target, "met": met, **figures}


def verdict_s1(r: dict[str, Any]) -> dict[str, Any]:
    alone, split, mixed = _p99(r, "s1_alone"), _p99(r, "s1_split"), _p99(r, "s1_mixed")
    ok = None if alone is None or split is None else \
        split <= 1.25 * alone and split < RED_LINE_MS and _served_all(r["s1_split"])
    ratio = None if alone is None or split is None or alone <= 0 else round(split / alone, 2)
    mratio = None if alone is None or mixed is None or alone <= 0 else round(mixed / alone, 2)
    return _verdict("split partial p99 <= 1.25 x alone p99 and < 300 ms", ok,
                    alone_p99_ms=alone, split_p99_ms=split, split_over_alone=ratio,
                    mixed_p99_ms=mixed, mixed_over_alone=mratio,
                    errors={k: r[k]["errors"] for k in ("s1_alone", "s1_split", "s1_mixed")
                            if r.get(k, {}).get("errors")})


def verdict_s2(r: dict[str, Any]) -> dict[str, Any]:
    cap, nocap = _p99(r, "s2_split"), _p99(r, "s2_split_nocap")
    return _verdict("with the cap, the other streams' partial p99 < 300 ms while one "
                    "client dumps 10 s",
                    None if cap is None else cap < RED_LINE_MS and _served_all(r["s2_split"]),
                    split_p99_ms=cap, split_nocap_p99_ms=nocap,
                    errors={k: r[k]["errors"] for k in ("s2_split", "s2_split_nocap")
                            if r.get(k, {}).get("errors")})


def verdict_s3(r: dict[str, Any]) -> dict[str, Any]:
    tput = r.get("s3_split_batch", {}).get("audio_s_per_wall_s")
    ceil = r.get("ceiling", {}).get("audio_s_per_wall_s")
    share = None if tput is None or not ceil else round(tput / ceil, 3)
    return _verdict("split batch throughput >= 90% of the raw engine on the same core",
                    None if share is None else share >= 0.9,
                    split_audio_s_per_wall_s=tput, ceiling_audio_s_per_wall_s=ceil,
                    share_of_ceiling=share)


def _steps(res: dict[str, Any]) -> dict[str, Any]:
    steps: dict[str, Any] = res.get("steps", {})
    return steps.get("realtime") or steps.get("mixed") or {}


def verdict_s4(r: dict[str, Any]) -> dict[str, Any]:
    cap, nocap = _steps(r.get("s4_sim-cap", {})), _steps(r.get("s4_sim-nocap", {}))
    share = cap.get("share_le_50ms")
    errors = {k: r[k]["errors"] for k in ("s4_sim-cap", "s4_sim-nocap")
              if r.get(k, {}).get("errors")}
    clean = _served_all(r.get("s4_sim-cap", {}))
    return _verdict("with the cap every step p99 <= 50 ms (>= 99% of steps in the <= 50 ms "
                    "buckets), every stream served; without it, the stall",
                    None if share is None else share >= 0.99 and clean,
                    streams_served=r.get("s4_sim-cap", {}).get("streams_served"),
                    cap_step_p99_ms=cap.get("p99_ms"), cap_share_le_50ms=share,
                    nocap_step_p99_ms=nocap.get("p99_ms"),
                    nocap_share_le_50ms=nocap.get("share_le_50ms"),
                    cap_steps_over_50ms=cap.get("over_50ms"),
                    nocap_steps_over_50ms=nocap.get("over_50ms"),
                    cap_max_step_at_most_ms=cap.get("max_at_most_ms"),
                    nocap_max_step_at_most_ms=nocap.get("max_at_most_ms"),
                    cap_partial_p99_ms=_p99(r, "s4_sim-cap"),
                    nocap_partial_p99_ms=_p99(r, "s4_sim-nocap"),
                    nocap_partial_max_ms=r.get("s4_sim-nocap", {}).get("partial_ms", {})
                    .get("max"), errors=errors)


def verdict_s5(r: dict[str, Any]) -> dict[str, Any]:
    gw, direct = r.get("s5_via_gateway", {}), r.get("s5_direct", {})
    gp, dp = _p99(r, "s5_via_gateway"), _p99(r, "s5_direct")
    added = None if gp is None or dp is None else round(gp - dp, 2)
    stream_s = gw.get("audio_s_sent") or 0.0
    cpu = gw.get("gateway_cpu_s")
    per = None if not stream_s or cpu is None else round(cpu / stream_s, 5)
    clean = _served_all(gw) and _served_all(direct)
    # The difference means something only while the baseline itself keeps the beat: a
    # machine too loaded to serve the streams directly makes "added" meaningless.
    baseline_ok = dp is not None and dp <= RED_LINE_MS
    return _verdict("added latency p99 (through the gateway minus direct to the workers) "
                    f"<= 10 ms, every stream served, direct p99 <= {RED_LINE_MS:g} ms",
                    None if added is None else added <= 10.0 and clean and baseline_ok,
                    streams_served_via_gateway=gw.get("streams_served"),
                    via_gateway_p99_ms=gp, direct_p99_ms=dp, added_p99_ms=added,
                    via_gateway_p50_ms=gw.get("partial_ms", {}).get("p50"),
                    direct_p50_ms=direct.get("partial_ms", {}).get("p50"),
                    gateway_cpu_s=cpu, stream_seconds=stream_s,
                    gateway_cpu_s_per_stream_s=per,
                    mid=lighter_figures(r, "s5_mid"), light=lighter_figures(r, "s5_light"),
                    errors={"via_gateway": gw.get("errors"), "direct": direct.get("errors")})


def lighter_figures(r: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The same comparison at a lighter load (informative, no target)."""
    gw, direct = r.get(f"{key}_via_gateway"), r.get(f"{key}_direct")
    if not gw or not direct:
        return None
    gp, dp = _p99(r, f"{key}_via_gateway"), _p99(r, f"{key}_direct")
    cpu, stream_s = gw.get("gateway_cpu_s"), gw.get("audio_s_sent") or 0.0
    return {"streams": gw["live_streams"], "via_gateway_p99_ms": gp, "direct_p99_ms": dp,
            "added_p99_ms": None if gp is None or dp is None else round(gp - dp, 2),
            "gateway_cpu_s_per_stream_s": None if not stream_s or cpu is None
            else round(cpu / stream_s, 5),
            "errors": {"via_gateway": gw.get("errors"), "direct": direct.get("errors")}}


def verdict_s6(r: dict[str, Any]) -> dict[str, Any]:
    x = r.get("s6_vad", {}).get("x_realtime")
    return _verdict("VAD >= 300 x real time on one core", None if x is None else x >= 300,
                    x_realtime=x)


def verdicts(doc: dict[str, Any]) -> dict[str, Any]:
    r = doc["results"]
    checks = {"s1": verdict_s1, "s2": verdict_s2, "s3": verdict_s3, "s4": verdict_s4,
              "s5": verdict_s5, "s6": verdict_s6}
    return {k: f(r) for k, f in checks.items() if k in doc["options"]["scenarios"]}


# --- BENCHMARKS.md -----------------------------------------------------------------


def _f(v: Any, digits: int = 1) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _g(v: Any) -> str:
    """A figure: small floats with 4 significant digits, others with 2 decimals."""
    if isinstance(v, float) and not isinstance(v, bool):
        return f"{v:.4g}" if abs(v) < 1 else f"{v:.2f}"
    return _f(v)


def _met(v: bool | None) -> str:
    return {True: "**met**", False: "**missed**", None: "not measured"}[v]


ROWS = (  # (results key, scenario, design, load)
    ("s1_alone", "1", "split", "streams alone"),
    ("s1_split", "1", "split", "streams + batch flood"),
    ("s1_mixed", "1", "mixed", "streams + batch flood"),
    ("s2_split", "2", "split", "streams + 10 s dumps"),
    ("s2_split_nocap", "2", "split-nocap", "streams + 10 s dumps"),
    ("s4_sim-cap", "4", "split (simulated)", "streams + long prefills"),
    ("s4_sim-nocap", "4", "split-nocap (simulated)", "streams + long prefills"),
    ("s5_direct", "5", "direct to workers (simulated, free)", "streams"),
    ("s5_via_gateway", "5", "through the gateway (simulated, free)", "streams"),
    ("s5_mid_direct", "5 (mid)", "direct to workers (simulated, free)", "streams"),
    ("s5_mid_via_gateway", "5 (mid)", "through the gateway (simulated, free)", "streams"),
    ("s5_light_direct", "5 (light)", "direct to workers (simulated, free)", "streams"),
    ("s5_light_via_gateway", "5 (light)", "through the gateway (simulated, free)", "streams"),
)


def latency_table(r: dict[str, Any]) -> list[str]:
    lines = [
        "| scen. | design | load | live streams | partial p50 / p95 / p99 / max (ms) "
        "| first partial p50 / p99 (ms) | final p50 / p99 (ms) | step p50 / p99 (ms), "
        "share ≤ 50 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, scen, design, load in ROWS:
        res = r.get(key)
        if not res:
            continue
        p, fp, fi = res["partial_ms"], res["first_partial_ms"], res["final_ms"]
        st = _steps(res)
        share = st.get("share_le_50ms")
        steps = (f"{_f(st.get('p50_ms'))} / {_f(st.get('p99_ms'))}, "
                 f"{_f(None if share is None else 100 * share)}% (n={st.get('count', 0)})"
                 if st else "—")
        lines.append(
            f"| {scen} | {design} | {load} | {res['live_streams']} | {_f(p['p50'])} / "
            f"{_f(p['p95'])} / {_f(p['p99'])} / {_f(p['max'])} | {_f(fp['p50'])} / "
            f"{_f(fp['p99'])} | {_f(fi['p50'])} / {_f(fi['p99'])} | {steps} | "
            f"{res['errors'] or '—'} |")
    return lines


def verdict_table(doc: dict[str, Any]) -> list[str]:
    v = doc["verdicts"]
    lines = ["| scenario | target | figures | result |", "|---|---|---|---|"]
    for key, ver in v.items():
        figures = ", ".join(f"{k} = {_g(x)}"
                            for k, x in ver.items()
                            if k not in ("target", "met") and x not in ({}, None)
                            and not (isinstance(x, dict) and not any(x.values())))
        lines.append(f"| {key[1:]} | {ver['target']} | {figures} | {_met(ver['met'])} |")
    return lines


def batch_lines(r: dict[str, Any]) -> list[str]:
    out = []
    ceil = r.get("ceiling")
    if ceil:
        out.append(f"- Raw engine ceiling (pocketsphinx Decoder, same VAD segments and "
                   f"decoder config, pinned to CPU {ceil['cpus']}): {ceil['audio_s']} s of "
                   f"audio in {ceil['wall_s']} s = **{ceil['audio_s_per_wall_s']} audio s per "
                   f"wall s**.")
    inter = r.get("interference")
    if inter:
        out.append(f"- Same chip, service aside: the realtime engine (100 ms chunks) on CPU "
                   f"{inter['rt_alone']['cpus']} takes {inter['rt_alone']['wall_s_per_audio_s']}"
                   f" s per audio s with the other CPU idle and "
                   f"{inter['rt_with_batch_busy']['wall_s_per_audio_s']} s while the batch "
                   f"engine decodes on the other CPU (x{inter['slowdown']}); "
                   f"{inter.get('rt_with_spin_busy', {}).get('wall_s_per_audio_s')} s while "
                   f"a plain interpreter loop with almost no memory traffic spins there "
                   f"(x{inter.get('spin_slowdown')}).")
    s3 = r.get("s3_split_batch")
    if s3:
        out.append(f"- `split` batch lane: {s3.get('completed')} of {s3.get('jobs')} jobs "
                   f"completed, {s3.get('audio_s')} s of audio between the first start and "
                   f"the last finish ({s3.get('span_s')} s) = **{s3.get('audio_s_per_wall_s')}"
                   f" audio s per wall s**.")
    for key, name in (("s1_split", "split"), ("s1_mixed", "mixed")):
        b = r.get(key, {}).get("batch_during_window")
        if b:
            out.append(f"- Batch progress during the `{name}` flood window (progress x "
                       f"audio / time since the first job started): "
                       f"{b.get('audio_s_per_wall_s')} audio s per wall s "
                       f"({b.get('statuses')}).")
    return out


def markdown(doc: dict[str, Any], notes: str = "", results_dir: str = "bench/results") -> str:
    """BENCHMARKS.md; ``results_dir`` is where results.json and the plots are, relative
    to the Markdown file."""
    rd = results_dir
    m, o, r = doc["machine"], doc["options"], doc["results"]
    pk = m["packages"]
    parts = [
        "# Benchmarks",
        "",
        f"Generated by `{doc.get('command', 'python -m bench run')}` (how it works: the "
        "Benchmark section of `docs/ARCHITECTURE.md`); "
        f"every figure below is in [`{rd}/results.json`]({rd}/results.json) "
        "with the machine, the options and the exact command line and `LANEGATE_*` "
        "environment of every process.",
        "",
        f"Machine: {m['nproc']} × {m['cpu_model']}, {m['mem_gib']} GiB, Linux {m['kernel']}, "
        f"Python {m['python']}, pocketsphinx {pk.get('pocketsphinx')}, aiohttp "
        f"{pk.get('aiohttp')}, {m['redis_server'].split(' sha')[0]}. Run {m['date_utc']}, "
        f"commit `{m['git_commit'][:10]}`, load average at start {m['load_avg_at_start'][0]:.2f}, "
        f"whole run {r.get('run_wall_s')} s.",
        "",
        f"Windows: {o['duration_s']:.0f} s per pocketsphinx window ({o['streams']} live "
        f"streams), {o['sim_duration_s']:.0f} s with {o['sim_streams']} simulated streams, "
        f"{o['scale_duration_s']:.0f} s with {o['scale_streams']} streams for the gateway "
        f"overhead. Batch flood: {o['flood_jobs']} async uploads of {o['flood_job_s']:.0f} s "
        f"each. Realtime worker on CPU {o['rt_cpus']}, batch worker on CPU {o['batch_cpus']}.",
        "",
        "## Targets",
        "",
        *verdict_table(doc),
        "",
        "## Latency per design",
        "",
        "Client-side: partial latency is the arrival time of a partial minus the send time "
        "of the frame holding its `audio_end_ms`; first partial is the first non-empty "
        "partial minus the first frame's send time; final latency is the same as partial "
        "latency for finals. Steps: the workers' `lanegate_step_duration_seconds` "
        "histograms over the window, scraped from the `/metrics` of the workers listed in "
        "the Redis registry (quantiles interpolated inside Prometheus buckets).",
        "",
        *latency_table(r),
        "",
        "## Batch throughput",
        "",
        *batch_lines(r),
        "",
    ]
    if "s6_vad" in r:
        v = r["s6_vad"]
        parts += ["## VAD", "", f"`bench.vad_speed.measure_vad_speed({o['vad_seconds']:.0f})` "
                  f"pinned to CPU {v.get('cpus')}: {_f(v.get('audio_s'), 0)} s of audio in "
                  f"{_f(v.get('wall_s'), 2)} s = **{_f(v.get('x_realtime'), 0)} × real "
                  "time**.", ""]
    parts += ["## Plots", "",
              f"![partial latency CDF per design]({rd}/latency_cdf.png)", "",
              f"![step durations per design]({rd}/step_histogram.png)", "",
              f"![worst partial latency over time]({rd}/timeline.png)", ""]
    if notes:
        parts += [notes.strip(), ""]
    return "\n".join(parts)
