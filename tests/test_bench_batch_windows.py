"""``bench.batch_windows.merge_spans``: the windows the span sweep decodes."""

from __future__ import annotations

import pytest

from bench.batch_windows import main, merge_spans

SPANS = [(0, 10), (12, 20), (25, 40), (41, 80), (90, 95)]


def test_no_span_keeps_the_segments() -> None:
    assert merge_spans(SPANS, 0) == SPANS


def test_consecutive_segments_join_while_the_window_fits() -> None:
    # 0-20 fits in 20 (the pause 10-12 inside it); 25-80 does not, nor 0-40
    assert merge_spans(SPANS, 20) == [(0, 20), (25, 40), (41, 80), (90, 95)]
    assert merge_spans(SPANS, 40) == [(0, 40), (41, 80), (90, 95)]
    assert merge_spans(SPANS, 100) == [(0, 95)]


def test_a_segment_longer_than_the_window_stays_whole() -> None:
    assert merge_spans([(0, 5), (6, 50), (51, 55)], 10) == [(0, 5), (6, 50), (51, 55)]


def test_every_sample_of_speech_stays_in_a_window() -> None:
    for limit in (0, 7, 20, 40, 1000):
        windows = merge_spans(SPANS, limit)
        for start, end in SPANS:
            assert any(a <= start and end <= b for a, b in windows), (limit, start, end)


def test_overlapping_or_unordered_spans_are_refused() -> None:
    with pytest.raises(ValueError, match="ordered"):
        merge_spans([(0, 10), (5, 20)], 30)
    with pytest.raises(ValueError, match="ordered"):
        merge_spans([(10, 5)], 30)


def test_a_span_past_whispers_30_s_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["a.wav", "a.txt", "--spans", "0,31"])
    assert "at most 30 s" in capsys.readouterr().err
