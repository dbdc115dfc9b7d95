"""Verdicts and the BENCHMARKS.md section of the Whisper benchmark (``whisper.json``).

The section sits between ``BEGIN``/``END`` markers in BENCHMARKS.md and is replaced
there (appended if absent), so ``python -m bench whisper-report`` can put it back
after ``python -m bench report`` rewrote the rest of the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.sections import WHISPER
from bench.verdict import Check, combine, judge, ratio

BEGIN, END = WHISPER.begin, WHISPER.end
SERVICE_MARGIN = 0.03  # WER through the service over the engine alone
P99_ALONE_MS = 1500.0
SPLIT_RATIO = 1.25
FINAL_P99_MS = 2000.0
PEER_SHARE = 0.2  # our partial p99 under the flood over WhisperLive's
WER_RISE = 0.03  # live WER under the flood over our own alone figure


def _p99(window: dict[str, Any] | None, key: str = "partial_ms") -> float | None:
    if not window:
        return None
    value = (window.get(key) or {}).get("p99")
    return None if value is None else float(value)


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 4)


def accuracy_verdicts(acc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model, svc in acc.get("service", {}).items():
        raw_wer = acc["raw"].get(model, {}).get("wer", {}).get("all")
        for path in ("stream", "batch"):
            check = Check(f"{model} {path} WER - raw WER", SERVICE_MARGIN)
            out[f"accuracy_{model}_{path}"] = judge(
                check, [_minus(svc[path]["wer"]["all"], raw_wer)])
    return out


def realtime_verdicts(rt: dict[str, Any]) -> dict[str, Any]:
    rounds = rt.get("rounds", [])
    alone = [_p99(r.get("alone")) for r in rounds]
    split = [ratio(_p99(r.get("split_flood")), _p99(r.get("alone"))) for r in rounds]
    finals = [max((v for v in (_p99(r.get(k), "final_ms") for k in ("alone", "split_flood"))
                   if v is not None), default=None) for r in rounds]
    return {"realtime_alone_p99": judge(Check("partial p99 alone (ms)", P99_ALONE_MS), alone),
            "realtime_split_ratio": judge(Check("split flood p99 / alone p99", SPLIT_RATIO),
                                          split),
            "realtime_final_p99": judge(Check("final p99, alone and split flood (ms)",
                                              FINAL_P99_MS), finals)}


def peer_verdicts(p: dict[str, Any]) -> dict[str, Any]:
    ours, theirs = p.get("lanegate", {}), p.get("whisperlive", {})
    share = ratio(_p99(ours.get("two_flood")), _p99(theirs.get("two_flood")))
    rise = _minus((ours.get("two_flood") or {}).get("live_wer"),
                  (ours.get("two") or {}).get("live_wer"))
    return {"peer_p99_share": judge(Check("our flood p99 / WhisperLive's", PEER_SHARE),
                                    [share]),
            "peer_wer_rise": judge(Check("our live WER with the uploads - without", WER_RISE),
                                   [rise])}


def streams_held(cap: dict[str, Any]) -> int:
    """Streams held by today's rule (``whisper_bench.held``): the steps before the first
    that does not hold."""
    from bench.whisper_bench import held

    n = 0
    for step in cap.get("steps", []):
        if not held(step):
            break
        n = step["streams"]
    return n


def capacity_verdict(r: dict[str, Any]) -> dict[str, Any]:
    ours = streams_held(r["capacity"]) if r.get("capacity") else None
    theirs = peer_streams_held(r.get("peer", {}).get("whisperlive", {}))
    if ours is None or theirs is None:
        return judge(Check("our streams held - WhisperLive's", 1, at_most=False), [None])
    return judge(Check("our streams held - WhisperLive's", 1, at_most=False), [ours - theirs])


def peer_streams_held(theirs: dict[str, Any]) -> int | None:
    """Streams WhisperLive served at partial p99 <= the limit: 0, 1 or 2 (its windows)."""
    held = None
    for n, key in ((1, "one"), (2, "two")):
        p99 = _p99(theirs.get(key))
        if p99 is None:
            return held
        if p99 > P99_ALONE_MS:
            return n - 1
        held = n
    return held


def verdicts(doc: dict[str, Any]) -> dict[str, Any]:
    r = doc["results"]
    out: dict[str, Any] = {}
    if "accuracy" in r:
        out.update(accuracy_verdicts(r["accuracy"]))
    if "realtime" in r:
        out.update(realtime_verdicts(r["realtime"]))
    if "peer" in r and "lanegate" in r["peer"]:
        out.update(peer_verdicts(r["peer"]))
        if "capacity" in r:
            out["capacity_vs_peer"] = capacity_verdict(r)
    out["overall"] = {"verdict": combine([v["verdict"] for v in out.values()]).value}
    return out


# --- markdown ------------------------------------------------------------------------

def _f(v: Any, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{float(v):.{digits}f}"


def _lat(window: dict[str, Any] | None, key: str = "partial_ms") -> str:
    s = (window or {}).get(key) or {}
    return f"{_f(s.get('p50'))} / {_f(s.get('p99'))}"


def accuracy_table(acc: dict[str, Any]) -> list[str]:
    conds = acc["conditions"]
    lines = [f"WER on {acc['clips']} espeak-ng clips ({len(conds)} conditions: voice@wpm, "
             "pink noise at a fixed SNR); *alone*: the engine called directly, each clip in "
             "one call; *stream*: the clips of a condition joined with pauses and streamed "
             "over `/v1/stream`; *batch*: the same joined audio via "
             "`POST /v1/transcriptions` `async=true`.", "",
             "| engine | path | " + " | ".join(conds) + " | all |",
             "|---|---|" + "---|" * (len(conds) + 1)]

    def row(name: str, path: str, wer: dict[str, Any]) -> str:
        return (f"| {name} | {path} | " + " | ".join(_f(wer.get(c), 3) for c in conds)
                + f" | **{_f(wer.get('all'), 3)}** |")

    for name, raw in acc["raw"].items():
        if "wer" in raw:
            rtf = raw["decode_s"] / raw["audio_s"] if raw.get("audio_s") else None
            lines.append(row(name, f"alone (RTF {_f(rtf, 3)})", raw["wer"]))
        else:
            lines.append(f"| {name} | {raw.get('error')} |" + " |" * (len(conds) + 1))
        svc = acc["service"].get(name)
        if svc:
            lines.append(row(name, "stream", svc["stream"]["wer"]))
            lines.append(row(name, "batch", svc["batch"]["wer"]))
    return lines


def realtime_table(rt: dict[str, Any]) -> list[str]:
    lines = ["| round | window | streams | partial p50 / p99 (ms) | final p50 / p99 (ms) | "
             "live WER | batch lane | errors |", "|---|---|---|---|---|---|---|---|"]
    for k, r in enumerate(rt.get("rounds", []), 1):
        for key in ("alone", "split_flood", "mixed_flood"):
            w = r.get(key) or {}
            lines.append(f"| {k} | {key} | {w.get('live_streams')} | {_lat(w)} | "
                         f"{_lat(w, 'final_ms')} | {_f(w.get('live_wer'), 3)} | "
                         f"{batch_text(w.get('batch'))} | {w.get('errors') or ''} |")
    return lines


def capacity_lines(cap: dict[str, Any]) -> list[str]:
    from bench.whisper_bench import held

    lines = ["| live streams | partial p50 / p99 (ms) | partials per stream-second | "
             "final p50 / p99 (ms) | live WER | held |", "|---|---|---|---|---|---|"]
    for s in cap["steps"]:
        lines.append(f"| {s['streams']} | {_lat(s)} | {_f(s.get('partials_per_stream_s'), 2)}"
                     f" | {_lat(s, 'final_ms')} | {_f(s['live_wer'], 3)} | "
                     f"{'yes' if held(s) else 'no'} |")
    lines += ["", f"One realtime CPU holds **{streams_held(cap)}** live streams at partial "
              f"p99 <= {cap['limit_ms']:.0f} ms and final p99 <= "
              f"{cap.get('final_limit_ms', 2000):.0f} ms."]
    return lines


def dump_lines(dump: dict[str, Any]) -> list[str]:
    lines = []
    for design, w in dump.items():
        steps = (w.get("steps") or {}).get("realtime") or {}
        buckets = steps.get("buckets", {})
        prev, cells = 0, []
        for le, count in buckets.items():
            if count - prev:
                cells.append(f"<= {le} s: {count - prev}")
            prev = count
        lines.append(f"* `{design}`: {steps.get('count')} steps, p50 {_f(steps.get('p50_ms'))} "
                     f"ms, p99 {_f(steps.get('p99_ms'))} ms, max <= "
                     f"{_f(steps.get('max_at_most_ms'))} ms; live partial p99 "
                     f"{_f(_p99(w))} ms; the dump's text caught up after "
                     f"{(w.get('dump') or {}).get('digest_s')} s. Step histogram: "
                     f"{'; '.join(cells)}")
    return lines


def batch_text(batch: dict[str, Any] | None) -> str:
    if not batch:
        return ""
    return (f"{batch.get('statuses')}, {_f(batch.get('audio_s_per_wall_s'), 2)} audio s "
            "per s so far")


def peer_table(p: dict[str, Any]) -> list[str]:
    lines = ["| server | window | partial lag p50 / p99 (ms) | live WER | uploads |",
             "|---|---|---|---|---|"]
    names = {"one": "1 stream", "two": "2 streams", "two_flood": "2 streams + uploads"}
    for server, side in (("WhisperLive", p.get("whisperlive", {})),
                         ("lanegate", p.get("lanegate", {}))):
        for key, label in names.items():
            w = side.get(key)
            if not w:
                continue
            up = w.get("uploads")
            up_text = ("; ".join(f"{u.get('status')} in {u.get('wall_s')} s" for u in up)
                       + (f"; {w['uploads_unfinished_at_end']} unfinished"
                          if w.get("uploads_unfinished_at_end") else "")) if up is not None \
                else batch_text(w.get("batch"))
            lines.append(f"| {server} | {label} | {_lat(w)} | {_f(w.get('live_wer'), 3)} | "
                         f"{up_text} |")
    return lines


def commands(doc: dict[str, Any]) -> str:
    by_command: dict[str, list[str]] = {}
    for part, command in doc.get("commands", {}).items():
        by_command.setdefault(command, []).append(part)
    if not by_command:
        return f"`{doc['command']}`"
    return "; ".join(f"`{c}` ({', '.join(parts)})" for c, parts in by_command.items())


def machine_lines(r: dict[str, Any]) -> list[str]:
    """Each part's wall time, the fixed-loop probe before and after it (seconds; higher is
    a slower machine) and the hypervisor's steal over it."""
    cells = []
    for part, m in r.get("part_machine", {}).items():
        probe = m.get("probe_s") or [None, None]
        cells.append(f"{part} {_f(m.get('wall_s'))} s (probe {_f(probe[0], 2)} / "
                     f"{_f(probe[1], 2)} s, steal {_f(100 * m.get('steal_share', 0), 1)} %, "
                     f"busy {_f(100 * m.get('busy_share', 0))} %)")
    return [f"Parts: {'; '.join(cells)}."] if cells else []


def section(doc: dict[str, Any]) -> str:
    r, o = doc["results"], doc["options"]
    out = [BEGIN, "## Whisper", "",
           f"Commands: {commands(doc)} (last run {doc['machine']['date_utc']}, commit "
           f"{doc['machine']['git_commit'][:7]}). Realtime worker, "
           f"gateway and redis-server on CPU {o['rt_cpus']}, batch worker on CPU "
           f"{o['batch_cpus']}; Whisper base int8, greedy. Latency as in the tables above: "
           "arrival of an event minus the send time of the frame holding its audio end."]
    if "accuracy" in r:
        out += ["", "### Accuracy", "", *accuracy_table(r["accuracy"])]
    out += ["", *machine_lines(r)]
    if "realtime" in r:
        out += ["", f"### Realtime lane, {o['streams']} live streams at real-time pace", "",
                f"Beside a flood of {o['flood_jobs']} x {o['flood_job_s']:.0f} s uploads "
                "(`split`: the batch worker on its own CPU; `mixed`: one worker for both).", "",
                *realtime_table(r["realtime"])]
    if "capacity" in r:
        out += ["", "### Live streams one CPU holds", "", *capacity_lines(r["capacity"])]
    if "dump" in r:
        out += ["", f"### Step durations while a client dumps {o['dump_s']:.0f} s", "",
                *dump_lines(r["dump"])]
    if "peer" in r and "error" not in r["peer"]:
        out += ["", "### Side by side with WhisperLive", "",
                "WhisperLive 0.10.0 (faster_whisper backend, the same model directory, "
                f"OMP_NUM_THREADS=1, taskset {r['peer']['whisperlive']['server']['cpus']}); its "
                "partial lag counts forward-moving messages (the latest segment end passed "
                "every earlier one). Its uploads go to its `/v1/audio/transcriptions`, ours "
                "to `/v1/transcriptions` `async=true`.", "", *peer_table(r["peer"])]
    v = doc.get("verdicts", {})
    if v:
        out += ["", "### Verdicts", "", "| check | figure (median of rounds) | verdict |",
                "|---|---|---|"]
        for key, item in v.items():
            if key != "overall":
                out.append(f"| {item['check']} | {_f(item.get('median'), 3)} | "
                           f"{item['verdict']} |")
    out.append(END)
    return "\n".join(out) + "\n"


def write_section(doc: dict[str, Any], markdown_path: Path) -> None:
    WHISPER.put(section(doc), markdown_path)
