"""The benchmark's pure parts: verdicts from rounds, /proc/stat steal, perf output, messages.

No stack is started: these are the rules a reader of BENCHMARKS.md trusts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench.attribution import costs
from bench.attribution import summarize as summarize_attribution
from bench.machine import parse_perf_csv, parse_proc_stat, steal
from bench.measure import messages
from bench.report import (
    disagreement_rule,
    gateway_round,
    rounds_text,
    upgrade,
    verdict_s1,
    verdict_s5,
    verdicts,
)
from bench.run import Options, round_count, round_scenarios
from bench.sections import SOAK, WHISPER, kept
from bench.soak import Sample, latency_by_window
from bench.soak import judge as soak_judge
from bench.verdict import Check, Rule, Verdict, combine, judge, judge_flags, median_error, spread

RATIO = Check("split_over_alone", 1.25)


def test_every_round_meeting_the_limit_is_met_and_none_is_missed() -> None:
    assert judge(RATIO, [1.0, 1.1, 1.2])["verdict"] == "met"
    assert judge(RATIO, [1.5, 2.0, 1.3])["verdict"] == "missed"


def test_a_median_far_from_the_limit_decides_when_rounds_disagree() -> None:
    # one slow round out of three: the median (1.05) is well under 1.25 - 10 %
    met = judge(RATIO, [1.0, 1.05, 2.3])
    assert (met["verdict"], met["median"], met["min"], met["max"]) == ("met", 1.05, 1.0, 2.3)
    assert met["rounds_passed"] == 2
    # one lucky round: the median (2.0) is far over the line
    assert judge(RATIO, [1.1, 2.0, 2.26])["verdict"] == "missed"


def test_disagreeing_rounds_with_a_median_near_the_line_are_unstable() -> None:
    # median 1.3 is within 10 % of 1.25 (1.125 .. 1.375)
    assert judge(RATIO, [1.2, 1.3, 1.5])["verdict"] == "unstable"
    assert judge(RATIO, [1.2, 1.24, 1.5])["verdict"] == "unstable"
    # a wider margin turns a clear verdict into an unstable one
    assert judge(RATIO, [1.0, 1.05, 2.3], Rule(margin=0.15))["verdict"] == "met"
    assert judge(RATIO, [1.0, 1.05, 2.3], Rule(margin=0.2))["verdict"] == "unstable"


def test_a_share_that_must_reach_its_limit_gets_a_margin_of_its_room() -> None:
    share = Check("share_of_ceiling", 0.9, at_most=False, share=True)
    # the margin is 10 % of 1 - 0.9 = 0.01: 0.905 is within it, 0.93 is not
    assert judge(share, [0.88, 0.905, 0.95])["verdict"] == "unstable"
    assert judge(share, [0.88, 0.93, 0.94])["verdict"] == "met"
    assert judge(share, [0.85, 0.86, 0.95])["verdict"] == "missed"


def test_rounds_without_a_figure_are_left_out() -> None:
    got = judge(RATIO, [None, 1.0, 1.1])
    assert (got["verdict"], got["rounds_measured"]) == ("met", 2)
    assert judge(RATIO, [None, None])["verdict"] == "not measured"
    assert spread([None, 3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0,
                                             "rounds": [None, 3.0, 1.0, 2.0]}


def test_yes_no_checks_and_the_scenario_verdict() -> None:
    assert judge_flags("served", [True, True])["verdict"] == "met"
    assert judge_flags("served", [True, False, True])["verdict"] == "unstable"
    assert judge_flags("served", [False, False])["verdict"] == "missed"
    assert combine(["met", "unstable", "met"]) is Verdict.UNSTABLE
    assert combine(["unstable", "missed"]) is Verdict.MISSED
    assert combine(["met", "met"]) is Verdict.MET
    assert combine(["not measured"]) is Verdict.NOT_MEASURED


def _window(p99: float, errors: dict[str, int] | None = None) -> dict[str, object]:
    return {"partial_ms": {"p99": p99}, "errors": errors or {}, "live_streams": 4}


def test_scenario_1_is_judged_on_the_ratio_within_each_round() -> None:
    # round 2 ran on a slow machine: both designs slow, the ratio within it still fine;
    # comparing across rounds (split of round 2 against alone of round 1) would miss
    rounds = [{"s1_alone": _window(140), "s1_split": _window(150)},
              {"s1_alone": _window(260), "s1_split": _window(290)},
              {"s1_alone": _window(150), "s1_split": _window(160)}]
    v = verdict_s1(rounds, Rule())
    assert v["verdict"] == "met"
    assert v["checks"][0]["rounds"] == pytest.approx([150 / 140, 290 / 260, 160 / 150])
    rounds[1]["s1_split"] = _window(290, {"connect: OSError": 1})
    assert verdict_s1(rounds, Rule())["verdict"] == "unstable"


def test_scenario_1_runs_alone_in_the_rounds_past_the_others() -> None:
    o = Options(scenarios=("s1", "s2", "s5"), rounds=3, s1_rounds=5)
    assert round_count(o) == 5
    assert [sorted(round_scenarios(o, k)) for k in range(5)] == \
        [["s1", "s2", "s5"]] * 3 + [["s1"]] * 2
    # without scenario 1 the extra rounds do not exist; fewer s1 rounds than rounds: all run
    assert round_count(Options(scenarios=("s2",), rounds=3, s1_rounds=5)) == 3
    short = Options(scenarios=("s1", "s2"), rounds=3, s1_rounds=2)
    assert round_count(short) == 3
    assert round_scenarios(short, 2) == {"s1", "s2"}


def test_each_scenario_is_judged_on_the_rounds_it_ran_in() -> None:
    # rounds 4 and 5 ran scenario 1 alone: scenario 2 is judged on its 3 rounds
    both = {"s1_alone": _window(100), "s1_split": _window(105), "s2_split": _window(120)}
    rounds = [{"round": k + 1, "scenarios": ["s1", "s2"], "machine": {}, "windows": both}
              for k in range(3)]
    rounds += [{"round": k + 4, "scenarios": ["s1"], "machine": {},
                "windows": {"s1_alone": _window(100), "s1_split": _window(150)}}
               for k in range(2)]
    doc = {"options": {"scenarios": ["s1", "s2"]}, "results": {"rounds": rounds}}
    v = verdicts(doc)
    ratio_check = v["s1"]["checks"][0]
    assert (ratio_check["rounds_measured"], ratio_check["rounds_passed"]) == (5, 3)
    assert ratio_check["median"] == pytest.approx(1.05)
    assert v["s1"]["verdict"] == "met"  # median 1.05, far under 1.25 - 10 %
    assert v["s2"]["checks"][0]["rounds_measured"] == 3
    assert v["s2"]["checks"][1]["rounds_measured"] == 3  # every stream served, 3 rounds
    assert rounds_text(doc).startswith("3 rounds, scenario 1 in 5")
    assert rounds_text({"results": {"rounds": rounds[:3]}}) == "3 rounds"


def _gateway_round(via_p99: float, direct_p99: float, cpu_s: float) -> dict[str, object]:
    via = {**_window(via_p99), "gateway_cpu_s": cpu_s,
           "messages": {"sent": 2000, "received": 1000, "stream_s": 200.0,
                        "sent_per_stream_s": 10.0, "received_per_stream_s": 5.0}}
    return {"s5_200_via_gateway": via, "s5_200_direct": _window(direct_p99)}


def test_gateway_capacity_per_stream_second_and_added_latency() -> None:
    g = gateway_round(_gateway_round(20.0, 13.0, 0.08), 200)
    assert g["gateway_cpu_s_per_stream_s"] == pytest.approx(0.0004)
    assert g["setup_cpu_ms_per_session"] is None  # no steady part measured
    assert g["added_p99_ms"] == pytest.approx(7.0)
    assert (g["sent_per_stream_s"], g["received_per_stream_s"]) == (10.0, 5.0)
    rounds = [_gateway_round(20.0, 13.0, 0.08), _gateway_round(22.0, 14.0, 0.09),
              _gateway_round(21.0, 12.0, 0.085)]
    for w in rounds:  # the target is the gateway against the same round's floor
        w["s5_200_floor"] = {**_window(5.0), "gateway_steady": {"cpu_s_per_stream_s": 0.00025}}
    v = verdict_s5(rounds, Rule(), [200], 200)
    assert v["verdict"] == "met"
    assert v["capacity"]["200"]["streams_per_core"] == round(1 / 0.000425)


def test_a_carried_streams_cost_is_the_steady_part_and_setup_is_per_session() -> None:
    window = _gateway_round(20.0, 13.0, 0.08)  # 0.0004 s per stream-second in all
    via = window["s5_200_via_gateway"]
    assert isinstance(via, dict)
    via["gateway_steady"] = {"cpu_s_per_stream_s": 0.0003, "stream_s": 150.0}
    g = gateway_round(window, 200)
    assert g["gateway_cpu_s_per_stream_s"] == pytest.approx(0.0003)
    assert g["window_cpu_s_per_stream_s"] == pytest.approx(0.0004)
    # 0.08 s in all, 0.06 s of it streaming (200 stream-s at the steady rate), 4 sessions
    assert g["setup_cpu_ms_per_session"] == pytest.approx(1000 * 0.02 / 4)


def test_the_gateway_is_set_against_the_bare_servers_floor_of_the_same_round() -> None:
    window = _gateway_round(20.0, 13.0, 0.08)
    window["s5_200_floor"] = {**_window(5.0), "gateway_steady": {"cpu_s_per_stream_s": 0.0002}}
    g = gateway_round(window, 200)
    assert g["floor_cpu_s_per_stream_s"] == pytest.approx(0.0002)
    assert g["gateway_over_floor"] == pytest.approx(2.0)  # 0.0004 over 0.0002
    assert gateway_round(_gateway_round(20.0, 13.0, 0.08), 200)["gateway_over_floor"] is None
    v = verdict_s5([window] * 3, Rule(), [200], 200)
    assert v["figures"]["floor_cpu_s_per_stream_s"]["median"] == pytest.approx(0.0002)


def test_added_latency_is_not_judged_where_the_baseline_itself_misses() -> None:
    rounds = [_gateway_round(800.0, 1400.0, 0.08)] * 3
    v = verdict_s5(rounds, Rule(), [200], 200)
    added = next(c for c in v["checks"] if c["check"].startswith("added"))
    assert added["verdict"] == "not measured"
    assert v["verdict"] == "missed"  # the direct baseline's own check
    assert v["figures"]["highest_load_direct_held"] is None


def test_messages_are_counted_per_stream_second() -> None:
    results = [{"kind": "live", "audio_s_sent": 10.0, "frames_sent": 101,
                "events_received": 40},
               {"kind": "live", "audio_s_sent": 10.0, "frames_sent": 101,
                "events_received": 60},
               {"kind": "dump", "audio_s_sent": 50.0, "frames_sent": 3, "events_received": 5}]
    m = messages(results)
    assert (m["sent"], m["received"], m["stream_s"]) == (205, 105, 20.0)
    assert (m["sent_per_stream_s"], m["received_per_stream_s"]) == (10.25, 5.25)
    assert messages([])["sent_per_stream_s"] is None


PROC_STAT = """cpu  100 0 50 1000 10 0 5 40 0 0
cpu0 50 0 25 500 5 0 3 20 0 0
cpu1 50 0 25 500 5 0 2 20 0 0
intr 12345 0 0
ctxt 999
"""


def test_steal_is_the_steal_column_delta_over_all_cpus() -> None:
    before = parse_proc_stat(PROC_STAT)
    assert before["cpu"] == [100, 0, 50, 1000, 10, 0, 5, 40]
    assert set(before) == {"cpu", "cpu0", "cpu1"}
    after = {k: list(v) for k, v in before.items()}
    # 185 jiffies pass: 30 user, 10 system, 100 idle, 5 softirq, 40 stolen
    after["cpu"] = [130, 0, 60, 1100, 10, 0, 10, 80]
    got = steal(before, after)
    assert got["steal_share"] == pytest.approx(40 / 185, abs=1e-4)
    assert got["busy_share"] == pytest.approx(85 / 185, abs=1e-4)
    assert steal(before, before) == {"steal_s": 0.0, "steal_share": 0.0, "busy_share": 0.0}


def test_perf_output_with_and_without_counters() -> None:
    assert parse_perf_csv("1234567,,instructions:u,1000,100.00,,\n") == 1234567
    assert parse_perf_csv("<not supported>,,instructions,0,100.00,,\n") is None
    assert parse_perf_csv("") is None


def test_a_results_file_from_before_the_rounds_renders_as_one_round() -> None:
    old = {"options": {"scenarios": ["s5"], "scale_streams": 500, "scale_mid_streams": 200,
                       "scale_light_streams": 0},
           "results": {"s5_via_gateway": _window(806), "s5_direct": _window(1402),
                       "s5_mid_via_gateway": _window(20.8), "s5_mid_direct": _window(13.0),
                       "run_wall_s": 760.0}}
    doc = upgrade(old)
    windows = doc["results"]["rounds"][0]["windows"]
    assert sorted(windows) == ["s5_200_direct", "s5_200_via_gateway", "s5_500_direct",
                               "s5_500_via_gateway"]
    assert doc["options"]["scale_streams"] == [200, 500]


def rss_series(values: list[int], every_s: float = 10.0) -> list[Sample]:
    return [Sample(i * every_s, {"gateway": v, "worker": 100_000}, {"gateway": 20})
            for i, v in enumerate(values)]


def test_the_soak_judges_memory_after_the_warm_up_only() -> None:
    # doubling during the warm-up (caches filling), flat afterwards: met
    warm = [50_000 + 5_000 * i for i in range(10)] + [100_000] * 30
    out = soak_judge(rss_series(warm), warmup_s=100, window_s=50, limit=0.10)
    assert out["verdict"] == "met"
    assert out["processes"]["gateway"]["growth"] == 0.0
    assert out["processes"]["gateway"]["rss_mib_at_end"] == round(100_000 / 1024, 1)


def test_the_soak_misses_a_steady_leak_and_a_run_too_short_to_judge() -> None:
    leak = [100_000 + 1_000 * i for i in range(40)]  # +1 % every sample
    out = soak_judge(rss_series(leak), warmup_s=100, window_s=50, limit=0.10)
    assert out["verdict"] == "missed"
    assert out["worst_growth"] > 0.10
    assert out["processes"]["worker"]["growth"] == 0.0  # the flat process is told apart
    short = soak_judge(rss_series([100_000] * 12), warmup_s=100, window_s=50, limit=0.10)
    assert short["verdict"] == "missed"
    assert "too short" in short["reason"]


def test_soak_latency_is_binned_by_arrival_time() -> None:
    results = [{"partial_at_s": [1.0, 2.0, 301.0], "partial_ms": [10.0, 30.0, 500.0]}]
    bins = latency_by_window(results, 300.0)
    assert [(b["from_s"], b["partials"]) for b in bins] == [(0.0, 2), (300.0, 1)]
    assert bins[1]["p99_ms"] == 500.0


def test_a_rerender_keeps_the_sections_other_commands_own(tmp_path: Path) -> None:
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# old\n")
    SOAK.put(f"{SOAK.begin}\nsoak v1\n{SOAK.end}\n", md)
    WHISPER.put(f"{WHISPER.begin}\nwhisper\n{WHISPER.end}\n", md)
    SOAK.put(f"{SOAK.begin}\nsoak v2\n{SOAK.end}\n", md)  # replaced in place
    text = md.read_text()
    assert text.count(SOAK.begin) == 1
    assert "soak v2" in text
    assert "soak v1" not in text
    rerendered = "# new\n" + kept(text)
    assert rerendered.startswith("# new\n")
    assert "whisper" in rerendered
    assert "soak v2" in rerendered
    assert kept("# nothing owned\n") == ""


def _server(cpu: float, events: float) -> dict[str, Any]:
    return {"cpu_s_per_stream_s": cpu, "frames_per_stream_s": 10.0,
            "events_per_stream_s": events, "errors": {}}


def test_attribution_splits_each_servers_cost_into_frames_and_events() -> None:
    rnd = {"gateway": _server(0.0007, 2.3), "gateway_quiet": _server(0.0005, 0.3),
           "floor": _server(0.0003, 2.1), "floor_quiet": _server(0.00025, 0.1)}
    assert costs(rnd, "gateway") == {"us_per_frame": 50.0, "us_per_event": 100.0}
    assert costs(rnd, "floor") == {"us_per_frame": 25.0, "us_per_event": 25.0}
    slow = {k: _server(2 * v["cpu_s_per_stream_s"], v["events_per_stream_s"])
            for k, v in rnd.items()}
    s = summarize_attribution([rnd, slow, rnd])
    assert s["gateway_us_per_frame"]["median"] == 50.0
    assert s["gateway_us_per_frame"]["rounds"] == [50.0, 100.0, 50.0]
    assert s["floor_quiet_cpu_s_per_stream_s"]["median"] == pytest.approx(0.00025)
    assert "floor_protocol_us_per_frame" not in s  # a round from before that floor


def test_attribution_sets_the_gateway_against_the_protocol_floor_too() -> None:
    rnd = {"gateway": _server(0.0007, 2.3), "gateway_quiet": _server(0.0005, 0.3),
           "floor_protocol": _server(0.0002, 2.1), "floor_protocol_quiet": _server(0.00015, 0.1)}
    s = summarize_attribution([rnd])
    assert s["floor_protocol_us_per_frame"]["median"] == 15.0
    assert s["floor_protocol_us_per_event"]["median"] == pytest.approx(25.0)


def test_an_infinite_margin_makes_every_disagreement_unstable() -> None:
    never = Rule(margin=math.inf)
    assert judge(RATIO, [1.0, 1.05, 2.3], never)["verdict"] == "unstable"
    assert judge(RATIO, [1.3, 1.4, 1.1], never)["verdict"] == "unstable"
    assert judge(RATIO, [1.0, 1.05, 1.1], never)["verdict"] == "met"
    assert "the median decides" in disagreement_rule(Rule(margin=0.1))
    assert "10%" in disagreement_rule(Rule(margin=0.1))
    assert "standard errors" in disagreement_rule(Rule(margin=0.1))
    assert "standard errors" not in disagreement_rule(Rule(margin=0.1, z=0))
    assert "the median decides" not in disagreement_rule(never)


def test_the_medians_standard_error_comes_from_the_rounds_spread() -> None:
    # MAD 1 -> sigma 1.4826 -> the median's error sigma x sqrt(pi / 2) / sqrt(3)
    assert median_error([1.0, 2.0, 3.0]) == pytest.approx(1.4826 * math.sqrt(math.pi / 2)
                                                          / math.sqrt(3))
    assert median_error([5.0, 5.0, 9.0]) == 0.0  # one far-off round moves the MAD not at all
    assert median_error([5.0]) == 0.0
    assert judge(RATIO, [1.0, 2.0, 3.0])["median_error"] == pytest.approx(1.0728, abs=1e-4)


def test_rounds_spread_wider_than_the_margin_are_unstable_not_a_verdict() -> None:
    # scenario 1's rounds in two runs back to back on a busy VM (bench/results/
    # results-epyc-noisy-run1.json, -run2.json): by the margin alone, missed and then met
    margin_only = Rule(z=0)
    run1, run2 = [1.089, 1.420, 1.746], [1.575, 0.991, 1.101]
    assert judge(RATIO, run1, margin_only)["verdict"] == "missed"
    assert judge(RATIO, run2, margin_only)["verdict"] == "met"
    # the median lies within two of its standard errors of the limit in both: unstable
    assert judge(RATIO, run1)["verdict"] == "unstable"
    assert judge(RATIO, run2)["verdict"] == "unstable"
    # one far-off round among close ones leaves the median's error small: still a verdict
    # (scenario 3's rounds on a quiet VM, bench/results/results-epyc-run1.json)
    share = Check("share_of_ceiling", 0.9, at_most=False, share=True)
    assert judge(share, [1.045, 1.081, 0.8745])["verdict"] == "met"
    # rounds that all agree need no median: met however wide they spread
    assert judge(RATIO, [0.5, 1.0, 1.24])["verdict"] == "met"
