"""A transcript and its renderings (json, text, srt, vtt, OpenAI verbose_json)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

FORMATS = ("json", "text", "srt", "vtt")


@dataclass(frozen=True)
class Word:
    word: str
    start: float  # seconds from the start of the audio
    end: float


@dataclass(frozen=True)
class Segment:
    start: float
    end: float
    text: str
    words: tuple[Word, ...] = ()
    cut: str = "endpoint"  # why the VAD ended it: endpoint, max_window or end


@dataclass(frozen=True)
class Transcript:
    text: str
    duration: float
    segments: tuple[Segment, ...] = field(default_factory=tuple)
    language: str = "en"

    @classmethod
    def from_segments(cls, segments: list[Segment], duration: float,
                      language: str = "en") -> Transcript:
        ordered = tuple(sorted(segments, key=lambda s: s.start))
        text = " ".join(s.text for s in ordered if s.text).strip()
        return cls(text=text, duration=duration, segments=ordered, language=language)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Transcript:
        segments = tuple(
            Segment(start=s["start"], end=s["end"], text=s["text"],
                    words=tuple(Word(**w) for w in s.get("words", ())),
                    cut=s.get("cut", "endpoint"))
            for s in data.get("segments", ())
        )
        return cls(text=data["text"], duration=data["duration"], segments=segments,
                   language=data.get("language", "en"))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def render(self, fmt: str) -> str:
        if fmt == "json":
            return self.to_json()
        if fmt == "text":
            return self.text + "\n"
        if fmt == "srt":
            return _cues(self.segments, srt=True)
        if fmt == "vtt":
            return "WEBVTT\n\n" + _cues(self.segments, srt=False)
        raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")


def _timestamp(seconds: float, *, srt: bool) -> str:
    millis = max(0, round(seconds * 1000))
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, millis = divmod(rest, 1000)
    sep = "," if srt else "."
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{sep}{millis:03d}"


def _cues(segments: tuple[Segment, ...], *, srt: bool) -> str:
    blocks = []
    spoken = [s for s in segments if s.text]
    for index, seg in enumerate(spoken, start=1):
        times = f"{_timestamp(seg.start, srt=srt)} --> {_timestamp(seg.end, srt=srt)}"
        head = f"{index}\n{times}" if srt else times
        blocks.append(f"{head}\n{seg.text}\n")
    return "\n".join(blocks)
