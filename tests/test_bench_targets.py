"""The benchmark's comparison and targets as a reader of BENCHMARKS.md checks them:
split and mixed on the same CPUs (in ``lanegate up``, compose and the bench), a stalled
stream counted at its worst, both sides of the trade in one table, the gateway against
its floor, the batch lane against faster-whisper's pipeline, the engine's defaults.

No stack is started (tests/test_bench_stack.py starts real ones)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import build_parser
from bench.audio import SHARED_SPEECH
from bench.measure import summarize, throughput
from bench.report import (
    markdown,
    trade_sentence,
    trade_table,
    verdict_s1,
    verdict_s3,
    verdict_s5,
    verdicts,
)
from bench.run import Options, lane_plan
from bench.stats import summary
from bench.verdict import RED_LINE_MS, WHISPER_CPU_P99_MS, Rule
from lanegate.settings import Settings
from lanegate.supervisor import build_children
from tests.deploy_support import compose, compose_cpu, load_yaml, merge

ROOT = Path(__file__).resolve().parents[1]


# --- the same hardware for both designs ---------------------------------------------


def test_the_bench_places_mixed_workers_exactly_where_split_has_its_workers() -> None:
    o = Options(rt_cpus="0", batch_cpus="1")
    split, mixed = lane_plan("split", o), lane_plan("mixed", o)
    assert sorted(w.cpus for w in mixed.workers) == sorted(w.cpus for w in split.workers)
    assert {w.lane for w in mixed.workers} == {"mixed"}
    assert (mixed.gateway_cpus, mixed.redis_cpus, mixed.load_cpus) == \
        (split.gateway_cpus, split.redis_cpus, split.load_cpus)


@pytest.mark.parametrize("realtime_workers", [1, 2])
def test_lanegate_up_places_mixed_workers_on_splits_cpus(realtime_workers: int) -> None:
    base = Settings(redis_url="redis://127.0.0.1:1/0", realtime_workers=realtime_workers)
    split, _ = build_children(base)
    mixed, _ = build_children(base.replace(lanes="mixed"))
    split_workers = [c for c in split if c.name.startswith("worker-")]
    mixed_workers = [c for c in mixed if c.name.startswith("worker-")]
    assert len(mixed_workers) == len(split_workers)  # one per realtime or batch place
    assert [c.cpus for c in mixed_workers] == [c.cpus for c in split_workers]
    assert all(c.argv[-1] == "mixed" for c in mixed_workers)
    gateway = {c.name: c.cpus for c in split}["gateway"]
    assert {c.name: c.cpus for c in mixed}["gateway"] == gateway
    if len(os.sched_getaffinity(0)) >= 2:  # pinned: two disjoint places, both used
        places = [c.cpus for c in mixed_workers]
        assert all(p for p in places)
        assert set().union(*(p or set() for p in places)) == os.sched_getaffinity(0)


def test_several_mixed_workers_get_their_own_ids_and_ports() -> None:
    mixed, _ = build_children(Settings(redis_url="redis://127.0.0.1:1/0", lanes="mixed",
                                       worker_id="w", worker_port=9100))
    workers = [c for c in mixed if c.name.startswith("worker-")]
    assert [c.env["LANEGATE_WORKER_ID"] for c in workers] == ["w-0", "w-1"]
    assert [c.env["LANEGATE_WORKER_PORT"] for c in workers] == ["9100", "9101"]


def _workers(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in data["services"].items()
            if s.get("command", [""])[:2] == ["lanegate", "worker"]}


def _place(svc: dict[str, Any]) -> tuple[str, str]:
    devices = (svc.get("deploy", {}).get("resources", {}).get("reservations", {})
               .get("devices", []))
    ids = ",".join(sorted(str(i) for d in devices for i in d.get("device_ids", [])))
    return ids, str(svc.get("cpuset", ""))


@pytest.mark.parametrize("cpu", [False, True])
def test_compose_mixed_keeps_every_workers_place_and_makes_it_mixed(cpu: bool) -> None:
    split = compose_cpu() if cpu else compose()
    mixed = merge(split, load_yaml(ROOT / "deploy" / "compose-mixed.yml"))
    assert set(_workers(mixed)) == set(_workers(split))
    for name, svc in _workers(mixed).items():
        assert svc["command"] == ["lanegate", "worker", "--lane", "mixed"], name
        assert _place(svc) == _place(_workers(split)[name]), name
        env = svc["environment"]
        assert env["LANEGATE_LANES"] == "mixed"
        # the gateway relays streams to every mixed worker: each names itself
        assert env.get("LANEGATE_WORKER_ADVERTISE_HOST") == name
        assert "blobs:/data/blobs" in svc.get("volumes", []), name  # jobs' audio
    assert mixed["services"]["gateway"]["environment"]["LANEGATE_LANES"] == "mixed"


# --- a stalled stream is its worst figure ---------------------------------------------


def _stream(partials_at: list[float], lane: str = "mixed") -> dict[str, Any]:
    return {"kind": "live", "lane": lane, "error": "", "partial_at_s": partials_at,
            "partial_ms": [200.0] * len(partials_at), "first_partial_ms": [],
            "final_ms": [900.0], "final_words": 5, "finals_without_audio_end": 0,
            "audio_s_sent": 44.0, "frames_sent": 440, "events_received": 10}


def test_a_stream_without_a_partial_in_the_window_counts_the_window_as_its_latency() -> None:
    steady = (2.0, 46.0)  # 44 s with every stream on
    out = summarize([_stream([]), _stream([])], steady)  # both got finals only
    assert out["stalled_streams"] == 2
    assert out["partial_ms"]["p99"] == pytest.approx(44_000.0)  # not None, not nan
    assert out["partial_cdf_ms"][-1][1] == pytest.approx(44_000.0)
    assert max(v for _, v in out["timeline_worst_ms"]) == pytest.approx(44_000.0)
    one = summarize([_stream([5.0, 6.0, 7.0]), _stream([])], steady)
    assert one["stalled_streams"] == 1
    assert one["partial_ms"]["max"] == pytest.approx(44_000.0)
    fine = summarize([_stream([5.0]), _stream([9.0])], steady)
    assert (fine["stalled_streams"], fine["stall_ms"]) == (0, None)
    # a refused stream is an error, not a stall
    assert summarize([{**_stream([]), "lane": "", "error": "busy"}], steady)[
        "stalled_streams"] == 0


# --- both sides of the trade, one table ---------------------------------------------


def _flood(p99: float | None, partials: int, batch: float, stalled: int = 0) -> dict[str, Any]:
    none = summary([])
    return {"partial_ms": {**none, "p99": p99}, "partial_all_ms": {"count": partials},
            "first_partial_ms": none, "final_ms": none, "steps": {},
            "audio_s_sent": 120.0, "live_streams": 2, "errors": {},
            "stalled_streams": stalled, "stall_ms": 60000.0 if stalled else None,
            "batch_during_window": {"audio_s_per_wall_s": batch}}


def _doc(rounds: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
    stacks = [{"design": "split", "processes": [
                  {"name": "worker-realtime-0", "argv": ["taskset", "-c", "0", "python"]},
                  {"name": "worker-batch-1", "argv": ["taskset", "-c", "1", "python"]}]},
              {"design": "mixed", "processes": [
                  {"name": "worker-mixed-0", "argv": ["taskset", "-c", "0", "python"]},
                  {"name": "worker-mixed-1", "argv": ["taskset", "-c", "1", "python"]}]}]
    o = {"engine": "whisper", "streams": 2, "flood_jobs": 3, "flood_job_s": 444.0,
         "duration_s": 40.0, "s1_duration_s": 60.0, "rt_cpus": "0", "batch_cpus": "1",
         "scenarios": ["s1"], "rounds": len(rounds), **options}
    return {"options": o, "stacks": stacks,
            "results": {"rounds": [{"round": k + 1, "machine": {}, "windows": w}
                                   for k, w in enumerate(rounds)]}}


def test_the_trade_table_shows_both_designs_from_the_same_rounds() -> None:
    rounds = [{"s1_alone": _flood(1100.0, 200, 0.0), "s1_split": _flood(1310.0, 168, 14.0),
               "s1_mixed": _flood(60000.0, 0, 10.3, stalled=2)} for _ in range(3)]
    doc = _doc(rounds)
    table = trade_table(doc)
    split_row = next(r for r in table if r.startswith("| `split`"))
    mixed_row = next(r for r in table if r.startswith("| `mixed`"))
    assert "realtime worker on CPU 0, batch worker on CPU 1" in split_row
    assert "mixed worker on CPU 0, mixed worker on CPU 1" in mixed_row
    assert "| 1310.0 (1310.0–1310.0) |" in split_row
    assert "| 14.0 (14.0–14.0) |" in split_row
    assert "6 of 6 (each counted as 60000.0 ms)" in mixed_row
    assert "| 0 (0–0) |" in mixed_row  # partials per stream-second
    assert trade_sentence(doc).startswith("`split` wins on both sides")
    assert "6 stream-window(s) got no partial" in trade_sentence(doc)
    v = verdict_s1([r for r in rounds], Rule(), WHISPER_CPU_P99_MS)
    assert v["figures"]["mixed_p99_ms"]["median"] == 60000.0  # the stall, not missing
    assert v["figures"]["mixed_stalled_streams"]["median"] == 2
    doc["verdicts"] = verdicts(doc)
    assert doc["verdicts"]["s1"]["checks"][1]["check"] == f"split_p99_ms <= {WHISPER_CPU_P99_MS:g}"


def test_a_split_that_gives_up_batch_for_latency_says_how_much() -> None:
    rounds = [{"s1_split": _flood(300.0, 168, 8.0), "s1_mixed": _flood(3000.0, 20, 10.0)}]
    assert trade_sentence(_doc(rounds)).startswith(
        "A trade: `split` is ahead on live latency (live partial p99 300.0 ms against "
        "3000.0 ms) and gives up 20.0 % of batch throughput")


def test_a_quick_p99_over_a_few_partials_is_not_ahead_on_live_latency() -> None:
    # mixed sent 8 partials in 120 stream-seconds, all quick; split 164, a little slower
    rounds = [{"s1_split": _flood(936.0, 164, 9.6), "s1_mixed": _flood(891.0, 8, 15.9)}]
    sentence = trade_sentence(_doc(rounds))
    assert sentence.startswith("A trade: `split` is ahead on live latency (its live streams "
                               "got 1.37 partials per stream-second against 0.06667)")
    assert "`mixed`'s lower p99 (891.0 against 936.0 ms) is over the few partials" in sentence
    even = [{"s1_split": _flood(936.0, 164, 9.6), "s1_mixed": _flood(891.0, 150, 15.9)}]
    assert trade_sentence(_doc(even)).startswith("`mixed` is ahead on live latency here")


def test_batch_figures_within_the_rounds_spread_are_the_same_not_a_win() -> None:
    # the full run of 6 December: split 20.4 (19.3-20.4), mixed 20.3 (20.2-20.3), and
    # mixed's worst stream waited 39.5 s for a partial where split's waited 4.6 s
    def waited(window: dict[str, Any], ms: float) -> dict[str, Any]:
        return {**window, "longest_wait_ms": {"max": ms}}

    rounds = [{"s1_split": waited(_flood(360.0, 235, b), 4600.0),
               "s1_mixed": waited(_flood(300.0, 133, m), 39500.0)}
              for b, m in ((20.4, 20.3), (19.3, 20.2), (20.4, 20.3))]
    sentence = trade_sentence(_doc(rounds))
    assert sentence.startswith("`split` is ahead on live latency here (its live streams got "
                               "1.96 partials per stream-second against 1.11) at the same "
                               "batch throughput within the rounds' spread (20.4 (19.3–20.4) "
                               "against 20.3 (20.2–20.3)")
    assert "wins on both sides" not in sentence
    apart = [{"s1_split": waited(_flood(360.0, 235, b), 4600.0),
              "s1_mixed": waited(_flood(300.0, 133, m), 39500.0)}
             for b, m in ((20.4, 20.3), (20.5, 20.2), (20.6, 20.3))]
    assert trade_sentence(_doc(apart)).startswith("`split` wins on both sides")


def test_a_flood_that_ran_out_inside_the_window_is_said_and_not_taken_as_a_rate() -> None:
    # the full runs at b4282d6: every upload of 3 x 444 s done before the 60 s window
    # ended, in both designs, so both read 1,331 audio s over the window: 20.4 and 20.4
    def job(status: str, progress: float, finished: float | None) -> dict[str, Any]:
        return {"status": status, "progress": progress, "audio_seconds": 444.0,
                "started_at": 100.0, "finished_at": finished}

    dry = throughput([job("completed", 1.0, 150.0), job("completed", 1.0, 160.0),
                      job("completed", 1.0, 155.0)], now=165.0)
    assert dry["audio_s_per_wall_s"] == pytest.approx(1332.0 / 60.0, abs=0.001)
    assert dry["ran_dry_s"] == 5.0  # the last upload finished 5 s before the window's end
    busy = throughput([job("completed", 1.0, 150.0), job("processing", 0.5, None),
                       job("completed", 1.0, 155.0)], now=165.0)
    assert busy["audio_s_per_wall_s"] == pytest.approx(1110.0 / 65.0, abs=0.001)
    assert "ran_dry_s" not in busy

    def window(batch: dict[str, Any]) -> dict[str, Any]:
        return {**_flood(300.0, 235, 0.0), "batch_during_window": batch}

    rounds = [{"s1_split": window(busy), "s1_mixed": window(dry)} for _ in range(3)]
    doc = _doc(rounds)
    mixed_row = next(r for r in trade_table(doc) if r.startswith("| `mixed`"))
    assert mixed_row.endswith("(the uploads ran out before the window ended in 3 of 3 "
                              "rounds) |")
    split_row = next(r for r in trade_table(doc) if r.startswith("| `split`"))
    assert "ran out" not in split_row
    assert "The uploads ran out before the window ended" in trade_sentence(doc)
    # a file from before ran_dry_s: every job completed by the window's end says the same
    old = {**dry, "audio_s_per_wall_s": 20.4}
    del old["ran_dry_s"]
    rounds = [{"s1_split": window(busy), "s1_mixed": window(old)}]
    assert "ran out before the window ended in 1 of 1" in trade_table(_doc(rounds))[-1]
    sentence = trade_sentence(_doc(rounds))
    assert "the batch figures cannot say which design does more" in sentence
    assert "wins on both sides" not in sentence


def test_a_floods_rate_is_taken_to_its_last_progress_write_not_the_windows_end() -> None:
    # round 1 and 2 of the full run at e10a04d: the same lane, 1,197.04 or 1,399.83 audio
    # s done by the window's end (one 200 s batch apart) over the same 65.9 s: 18.2 or
    # 21.2, as a batch's progress had just been written or not
    def job(status: str, progress: float, updated: float, finished: float | None = None
            ) -> dict[str, Any]:
        return {"status": status, "progress": progress, "audio_seconds": 888.0,
                "started_at": 100.0, "updated_at": updated, "finished_at": finished}

    first = job("completed", 1.0, 140.0, 140.0)
    written_late = throughput([first, job("processing", 0.35, 165.0),
                               job("queued", 0.0, 99.0)], now=166.0)
    written_early = throughput([first, job("processing", 0.125, 156.0),
                                job("queued", 0.0, 99.0)], now=166.0)
    # 888 x 1.35 over 65 s and 888 x 1.125 over 56 s: both about 18 audio s per wall s
    assert written_late["audio_s_per_wall_s"] == pytest.approx(1198.8 / 65.0, abs=0.001)
    assert written_early["audio_s_per_wall_s"] == pytest.approx(999.0 / 56.0, abs=0.001)
    assert (written_late["progress_age_s"], written_early["progress_age_s"]) == (1.0, 10.0)
    # a running job's progress of unknown time: the window's end, as before
    unknown = {**job("processing", 0.5, 0.0), "updated_at": None}
    assert throughput([first, unknown], now=166.0)["span_s"] == 66.0


def test_the_default_flood_outlasts_scenario_1s_window() -> None:
    # the uploads hold more audio than split's batch lane (~22 audio s per wall s) does
    # in the window and its 2 s lead, with half again to spare (3 x 444 s did not);
    # `mixed` on both CPUs (~33) still finishes them near its window's end (8a80aa9)
    o = Options()
    assert o.flood_jobs * o.job_s > 1.5 * 22.0 * (o.d1 + 2.0)


def test_each_streams_longest_wait_for_a_partial_is_measured() -> None:
    steady = (2.0, 46.0)
    out = summarize([_stream([3.0, 4.0, 30.0]), _stream([10.0, 40.0])], steady)
    # the first waited 26 s (4 -> 30), the second 30 s (10 -> 40), ends included
    assert out["longest_wait_ms"]["max"] == pytest.approx(30_000.0)
    assert out["longest_wait_ms"]["count"] == 2
    assert summarize([_stream([])], steady)["longest_wait_ms"]["max"] == pytest.approx(44_000.0)


def test_benchmarks_md_opens_with_the_trade_on_the_default_engine() -> None:
    rounds = [{"s1_alone": _flood(1100.0, 200, 0.0), "s1_split": _flood(1310.0, 168, 14.0),
               "s1_mixed": _flood(None, 0, 10.3, stalled=2)}]
    doc = _doc(rounds, wav=str(SHARED_SPEECH), sim_duration_s=30.0, sim_streams=200,
               scale_duration_s=20.0, scale_streams=[200])
    doc["machine"] = {"nproc": 2, "cpu_model": "cpu", "mem_gib": 1, "kernel": "k",
                      "python": "3", "packages": {}, "redis_server": "Redis v=7",
                      "date_utc": "now", "git_commit": "abcdef0123",
                      "load_avg_at_start": [0.0]}
    doc["verdicts"] = verdicts(doc)
    text = markdown(doc)
    first = text.split("\n## ")[1]
    assert first.startswith("The trade on the default engine: `split` and `mixed` on the "
                            "same CPUs")
    assert "two_cities.wav" in first


# --- targets ----------------------------------------------------------------------


def _gateway(cpu: float, floor: float) -> dict[str, Any]:
    def w(p99: float) -> dict[str, Any]:
        return {"partial_ms": {"p99": p99}, "errors": {}, "live_streams": 200}
    return {"s5_200_via_gateway": {**w(15.0), "gateway_steady": {"cpu_s_per_stream_s": cpu},
                                   "messages": {}},
            "s5_200_direct": w(13.0),
            "s5_200_floor": {**w(5.0), "gateway_steady": {"cpu_s_per_stream_s": floor}}}


def test_the_gateway_target_is_twice_its_floor_with_streams_per_core_beside_it() -> None:
    # 0.001 over 0.0005 is 2.0 x, 0.0011 over 0.0005 2.2 x: the median of the ratios
    v = verdict_s5([_gateway(0.0009, 0.0005), _gateway(0.001, 0.0005),
                    _gateway(0.0009, 0.0005)], Rule(), [200], 200)
    ratio = v["checks"][0]
    assert ratio["check"] == "gateway_over_floor at 200 <= 2"
    assert ratio["median"] == pytest.approx(1.8)
    assert v["verdict"] == "met"
    assert v["figures"]["streams_per_gateway_core"] == round(1 / 0.0009)
    assert v["figures"]["streams_per_core_on_the_floor"] == 2000
    slow = verdict_s5([_gateway(0.0013, 0.0005)] * 3, Rule(), [200], 200)
    assert slow["checks"][0]["verdict"] == "missed"  # 2.6 x: the ratio, not the absolute
    assert next(c for c in slow["checks"] if c["check"].startswith("added"))[
        "verdict"] == "met"  # 2 ms added, within 10


def _ceiling(fw_rate: float, fw_wer: float) -> dict[str, Any]:
    return {"faster_whisper": {"audio_s_per_wall_s": fw_rate, "wer": fw_wer, "words": 1190},
            "lanegate": {"audio_s_per_wall_s": fw_rate * 1.1, "wer": fw_wer, "words": 1190}}


def test_the_whisper_batch_lane_is_judged_against_batched_inference_pipeline() -> None:
    def rnd(ours: float, wer: float) -> dict[str, Any]:
        return {"ceiling": _ceiling(10.0, 0.05),
                "s3_split_batch": {"audio_s_per_wall_s": ours, "wer": wer}}
    v = verdict_s3([rnd(9.5, 0.05), rnd(9.6, 0.04), rnd(9.4, 0.05)], Rule(), "whisper")
    assert [c["verdict"] for c in v["checks"]] == ["met", "met"]
    assert v["checks"][0]["median"] == pytest.approx(0.95)
    worse = verdict_s3([rnd(12.0, 0.08)] * 3, Rule(), "whisper")
    assert [c["verdict"] for c in worse["checks"]] == ["met", "missed"]  # faster, fewer right
    slow = verdict_s3([rnd(8.0, 0.05)] * 3, Rule(), "whisper")
    assert slow["verdict"] == "missed"


# --- the engine and its defaults ------------------------------------------------------


def test_whisper_is_the_default_engine_with_the_shared_recording() -> None:
    o = Options()
    assert o.engine == "whisper"
    assert (o.streams, o.duration_s, o.s1_duration_s) == (2, 40.0, 60.0)
    if SHARED_SPEECH.exists():
        assert o.wav == SHARED_SPEECH
    assert lane_plan("split", o).env["LANEGATE_ENGINE"] == "whisper"
    ps = build_parser().parse_args(["run", "--engine", "pocketsphinx"])
    fields = {k: v for k, v in vars(ps).items() if k not in ("command", "markdown")}
    po = Options(**fields)
    assert (po.streams, po.duration_s, po.s1_duration_s, po.flood_job_s) == \
        (4, 20.0, 120.0, 720.0)
    assert po.wav is None  # espeak-ng sentences, as before
    assert lane_plan("mixed", po).env["LANEGATE_ENGINE"] == "pocketsphinx"
    given = build_parser().parse_args(["run", "--duration-s", "9"])
    assert Options(**{k: v for k, v in vars(given).items()
                      if k not in ("command", "markdown")}).duration_s == 9.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--engine", "vosk"])


def test_out_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `--out /tmp/run/results.json` made a folder named results.json holding results.json
    for bad in (str(tmp_path / "results.json"), str(tmp_path / "x.JSON")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["run", "--out", bad])
        assert "give a folder; results.json and the plots are written into it" in \
            capsys.readouterr().err
    existing = tmp_path / "notes"
    existing.write_text("")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--out", str(existing)])
    assert build_parser().parse_args(["run", "--out", str(tmp_path / "run1")]).out == \
        tmp_path / "run1"


def test_the_live_limit_follows_the_engine() -> None:
    rounds = [{"s1_alone": _flood(900.0, 200, 0.0), "s1_split": _flood(1000.0, 168, 14.0)}]
    assert verdicts(_doc(rounds))["s1"]["verdict"] == "met"  # Whisper on a CPU: 1500 ms
    ps = verdicts(_doc(rounds, engine="pocketsphinx"))["s1"]
    assert ps["checks"][1]["check"] == f"split_p99_ms <= {RED_LINE_MS:g}"
    assert ps["verdict"] == "missed"
