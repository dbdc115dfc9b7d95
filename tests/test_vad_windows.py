"""``vad.decode_windows`` (the batch lane's decode windows) and ``lanes.job_audio.to_cues``
(a window's words placed back on its VAD segments)."""

from __future__ import annotations

import pytest

from bench.batch_windows import main
from engines.base import Hypothesis
from lanegate.transcript import Word
from lanes.job_audio import to_cues
from vad import SegmentEnded, Window, decode_windows

SPANS = [(0, 10), (12, 20), (25, 40), (41, 80), (90, 95)]


def segs(spans: list[tuple[int, int]]) -> list[SegmentEnded]:
    return [SegmentEnded(a, b, "endpoint") for a, b in spans]


def spans_of(windows: list[Window]) -> list[tuple[int, int]]:
    return [(w.start, w.end) for w in windows]


def test_no_window_keeps_the_segments() -> None:
    assert spans_of(decode_windows(segs(SPANS), 0)) == SPANS


def test_consecutive_segments_join_while_the_window_fits() -> None:
    # 0-20 fits in 20 (the pause 10-12 inside it); 25-80 does not, nor 0-40
    assert spans_of(decode_windows(segs(SPANS), 20)) == [(0, 20), (25, 40), (41, 80), (90, 95)]
    assert spans_of(decode_windows(segs(SPANS), 40)) == [(0, 40), (41, 80), (90, 95)]
    assert spans_of(decode_windows(segs(SPANS), 100)) == [(0, 95)]


def test_a_segment_longer_than_the_window_stays_whole() -> None:
    found = decode_windows(segs([(0, 5), (6, 50), (51, 55)]), 10)
    assert spans_of(found) == [(0, 5), (6, 50), (51, 55)]


def test_every_segment_is_in_exactly_one_window_in_order() -> None:
    for limit in (0, 7, 20, 40, 1000):
        windows = decode_windows(segs(SPANS), limit)
        assert [(p.start, p.end) for w in windows for p in w.parts] == SPANS, limit
        assert all(w.length <= max(limit, 0) or len(w.parts) == 1 for w in windows)


def test_a_window_ends_as_its_last_segment_was_cut() -> None:
    window = decode_windows([SegmentEnded(0, 10, "endpoint"),
                             SegmentEnded(12, 20, "max_window")], 100)[0]
    assert window.reason == "max_window"


def test_overlapping_or_unordered_segments_are_refused() -> None:
    with pytest.raises(ValueError, match="ordered"):
        decode_windows(segs([(0, 10), (5, 20)]), 30)
    with pytest.raises(ValueError, match="ordered"):
        decode_windows(segs([(10, 5)]), 30)


def test_a_window_past_whispers_30_s_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["a.wav", "a.txt", "--spans", "0,31"])
    assert "at most 30 s" in capsys.readouterr().err


# --- to_cues ------------------------------------------------------------------------
RATE = 16000
#: two sentences, 0.5-2.0 s and 3.0-4.0 s of a job, decoded as one window from 0.5 s
TWO = Window((SegmentEnded(8000, 32000, "endpoint"), SegmentEnded(48000, 64000, "end")))


def word(text: str, start: float, end: float) -> Word:
    return Word(text, start, end)


def test_each_segment_of_a_window_gets_its_own_cue_with_its_words() -> None:
    # window times: the pause between the parts is 1.5-2.5 s, split at 2.0 s
    hyp = Hypothesis(" It was spring. We had hope.",
                     (word(" It", 0.0, 0.3), word(" was", 0.3, 0.6), word(" spring.", 0.6, 1.4),
                      word(" We", 2.6, 2.8), word(" had", 2.8, 3.0), word(" hope.", 3.0, 3.4)),
                     "en")
    first, second = to_cues(TWO, hyp)
    assert (first.start, first.end, first.text, first.cut) == (0.5, 2.0, "It was spring.",
                                                               "endpoint")
    assert (second.start, second.end, second.text, second.cut) == (3.0, 4.0, "We had hope.",
                                                                   "end")
    # word times are on the job's timeline
    assert [w.start for w in second.words] == [3.1, 3.3, 3.5]


def test_a_word_in_the_pause_goes_to_the_side_its_middle_is_on() -> None:
    hyp = Hypothesis(" yes no", (word(" yes", 1.3, 1.9), word(" no", 1.9, 2.4)), "en")
    first, second = to_cues(TWO, hyp)
    assert (first.text, second.text) == ("yes", "no")


def test_words_without_their_own_spaces_are_joined_with_one() -> None:
    hyp = Hypothesis("it was spring we had hope",
                     (word("it", 0.0, 0.3), word("was", 0.3, 0.6), word("spring", 0.6, 1.4),
                      word("we", 2.6, 2.8), word("had", 2.8, 3.0), word("hope", 3.0, 3.4)))
    assert [c.text for c in to_cues(TWO, hyp)] == ["it was spring", "we had hope"]


def test_a_segment_with_no_word_gets_an_empty_cue() -> None:
    hyp = Hypothesis(" hope", (word(" hope", 3.0, 3.4),), "en")
    assert [c.text for c in to_cues(TWO, hyp)] == ["", "hope"]


def test_a_window_of_one_segment_or_without_word_times_is_one_cue() -> None:
    one = Window((SegmentEnded(8000, 32000, "endpoint"),))
    assert [c.text for c in to_cues(one, Hypothesis(" Hi there.", (), "en"))] == ["Hi there."]
    whole = to_cues(TWO, Hypothesis(" It was spring. We had hope.", (), "en"))
    assert [(c.start, c.end, c.text) for c in whole] == [(0.5, 4.0, "It was spring. We had hope.")]
