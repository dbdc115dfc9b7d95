"""bench.live_quality's figures from a stream's recorded events (no stack): partial
latency from the frame holding ``audio_end_ms``, word lags, the partial words a final
changed, repeated phrases, and the BENCHMARKS.md section."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import sections
from bench.live_quality import (
    Run,
    counts,
    longest_speech_gap,
    render,
    repeated_phrases,
    setting,
    streams_held,
    timing,
)


def run() -> Run:
    """2 s of audio sent from t=100 in 100 ms frames; one segment: a partial showing
    "the cat" (the final says "the hat") and the final."""
    r = Run(sent=[100.0 + 0.1 * k for k in range(20)], seconds=2.0)
    r.events = [
        (100.9, {"type": "partial", "segment": 0, "text": "the", "audio_end_ms": 700}),
        (101.5, {"type": "partial", "segment": 0, "text": "the cat", "audio_end_ms": 1300}),
        (102.2, {"type": "final", "segment": 0, "text": "the hat", "words": [
            {"word": "the", "start": 0.2, "end": 0.45},
            {"word": "hat", "start": 0.5, "end": 0.95}]}),
        (102.3, {"type": "done"}),
    ]
    return r


def test_latencies_lags_and_changed_words_come_from_the_events() -> None:
    fig = timing([run()])
    # partials: 100.9 - sent(700 ms: frame 7, 100.7) and 101.5 - sent(1300: 101.3)
    assert fig["partial_ms"] == {"p50": 200.0, "p99": 200.0}
    assert fig["partials_per_stream_s"] == 1.0
    # "the" ends at 0.45 s (frame 4, sent 100.4): first shown 100.9, final 102.2;
    # "hat" ends at 0.95 s (frame 9, 100.9): first shown (as "cat") 101.5
    assert fig["word_to_partial_ms"]["p99"] == 600.0
    assert sorted(fig["word_to_final_ms"].values()) == [1800.0, 1800.0]  # 1300, 1800 by rank
    assert fig["partial_words_changed"] == 0.5  # "cat" became "hat"


def test_a_phrase_said_twice_that_the_reference_says_once_is_found() -> None:
    ref = "it was the spring of hope it was the winter of despair"
    assert repeated_phrases(ref, ref) == []
    doubled = ref + " it was the spring of hope it was the winter"
    assert "it was the spring of hope" in repeated_phrases(ref, doubled)


def test_the_section_is_rendered_between_its_markers(tmp_path: Path) -> None:
    fig = timing([run()])
    result = {"wav": "x.wav", "rt_cpus": "0", "espeak_s": 40.0, "host": "a test",
              "accuracy": {"recording": {"stream": 0.03, "batch": 0.025, "repeated": []}},
              "one_stream": fig, "latency": {"2 alone": fig}}
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n")
    sections.LIVE_QUALITY.put(render(result), md)
    text = md.read_text()
    assert "| shared recording (two_cities.wav) | 0.03 | 0.025 | 0 |" in text
    assert "| 2 alone | 200.0 / 200.0 | 1.0 |" in text
    assert sections.kept(text).strip().endswith(sections.LIVE_QUALITY.end)


def test_the_longest_speech_without_a_partial_is_measured_on_the_audio() -> None:
    """1 s of silence, 2 s of a 130 Hz sawtooth (a buzz webrtcvad calls voiced), 1 s of
    silence: partials at 1.5 s and 3.5 s, the final at 4 s. The most voiced audio between
    two marks is 1.5-3.5 s: 1.5 s of buzz."""
    t = np.arange(2 * 16000) / 16000
    tone = (16000 * ((t * 130) % 1 - 0.5)).astype(np.int16).tobytes()
    pcm = bytes(32000) + tone + bytes(32000)
    r = Run(events=[(1.0, {"type": "partial", "audio_end_ms": 1500}),
                    (2.0, {"type": "partial", "audio_end_ms": 3500}),
                    (3.0, {"type": "final", "end_ms": 4000})])
    gap = longest_speech_gap(r, pcm)
    assert (gap["from_ms"], gap["to_ms"]) == (1500, 3500)
    assert gap["speech_s"] == pytest.approx(1.5, abs=0.2)  # webrtcvad's hangover
    assert longest_speech_gap(Run(), pcm)["speech_s"] == pytest.approx(2.0, abs=0.2)


def test_the_streams_a_core_holds_are_the_most_that_met_both_targets() -> None:
    def fig(p99: float, rate: float) -> dict[str, Any]:
        return {"partial_ms": {"p50": 1.0, "p99": p99}, "partials_per_stream_s": rate,
                "word_to_partial_ms": {"p50": 1.0, "p99": 1.0},
                "word_to_final_ms": {"p50": 1.0, "p99": 1.0}, "partial_words_changed": 0.1,
                "errors": []}

    rows = {"2 alone": fig(450, 1.9), "6 alone": fig(960, 1.1), "8 alone": fig(1700, 0.9),
            "2 beside flood": fig(470, 1.8), "4 beside flood": fig(900, 0.7)}
    assert streams_held(rows) == {"alone": "6 (not 8)", "beside flood": "2 (not 4)"}
    assert streams_held({"6 alone": fig(2700, 1.5)}) == {"alone": "none of 6"}
    text = render({"wav": "x.wav", "rt_cpus": "0", "espeak_s": 40.0, "latency": rows,
                   "dialogue": {"seconds": 34.0, "gaps": [{"speech_s": 1.2}, {"speech_s": 1.6}]}})
    assert "1.20, 1.60 s (target 1.5 s: missed)" in text
    assert "alone 6 (not 8); beside flood 2 (not 4)" in text


def test_settings_and_counts_are_checked_before_a_stack_starts() -> None:
    assert setting("whisper_step_window_s=5") == ("LANEGATE_WHISPER_STEP_WINDOW_S", "5")
    for bad in ("whisper_step_window_s=50", "nope=1", "whisper_step_window_s", "=5"):
        with pytest.raises(argparse.ArgumentTypeError):
            setting(bad)
    assert counts("2,6,8") == (2, 6, 8)
    for bad in ("0", "2,x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            counts(bad)
