"""bench.live_quality's figures from a stream's recorded events (no stack): partial
latency from the frame holding ``audio_end_ms``, word lags, the partial words a final
changed, repeated phrases, and the BENCHMARKS.md section."""

from __future__ import annotations

from pathlib import Path

from bench import sections
from bench.live_quality import Run, render, repeated_phrases, timing


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
