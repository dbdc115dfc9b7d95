"""Transcript renderings: what a user gets with ?format=json|text|srt|vtt."""

from __future__ import annotations

import json

import pytest

from lanegate.transcript import Segment, Transcript, Word


def sample() -> Transcript:
    return Transcript.from_segments(
        [Segment(3723.5, 3725.25, "second part", (Word("second", 3723.5, 3724.0),)),
         Segment(0.0, 1.5, "hello world", (Word("hello", 0.1, 0.5), Word("world", 0.6, 1.4))),
         Segment(2.0, 2.5, "")],
        duration=3726.0)


def test_segments_are_ordered_and_text_joined() -> None:
    t = sample()
    assert [s.start for s in t.segments] == [0.0, 2.0, 3723.5]
    assert t.text == "hello world second part"


def test_json_round_trips_with_words() -> None:
    t = sample()
    again = Transcript.from_dict(json.loads(t.render("json")))
    assert again == t
    assert again.segments[0].words[1] == Word("world", 0.6, 1.4)


def test_srt_numbers_cues_and_uses_commas() -> None:
    srt = sample().render("srt")
    assert srt.splitlines()[:3] == ["1", "00:00:00,000 --> 00:00:01,500", "hello world"]
    assert "2\n01:02:03,500 --> 01:02:05,250\nsecond part" in srt
    assert srt.count("-->") == 2  # the silent segment has no cue


def test_vtt_has_header_and_dots() -> None:
    vtt = sample().render("vtt")
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nhello world")


def test_text_and_unknown_format() -> None:
    assert sample().render("text") == "hello world second part\n"
    with pytest.raises(ValueError, match="unknown format"):
        sample().render("docx")
