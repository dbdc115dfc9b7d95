"""The sections of BENCHMARKS.md that one command owns (the Whisper benchmark, the soak,
the GPU run),
each between its own markers: that command puts its section in place, and a re-render
of the rest of the file (``python -m bench report``) carries them over."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Section:
    begin: str
    end: str

    def find(self, text: str) -> str | None:
        """The section in ``text``, markers included, or None."""
        if self.begin not in text or self.end not in text:
            return None
        return self.begin + text.split(self.begin, 1)[1].split(self.end, 1)[0] + self.end

    def put(self, block: str, markdown_path: Path) -> None:
        """Replace the section in the file by ``block`` (which has the markers), or
        append it."""
        text = markdown_path.read_text() if markdown_path.exists() else ""
        if self.find(text) is not None:
            head, rest = text.split(self.begin, 1)
            text = head + block + rest.split(self.end, 1)[1].lstrip("\n")
        else:
            text = text.rstrip("\n") + "\n\n" + block
        markdown_path.write_text(text)


WHISPER = Section("<!-- whisper-bench:begin -->", "<!-- whisper-bench:end -->")
SOAK = Section("<!-- soak:begin -->", "<!-- soak:end -->")
GPU = Section("<!-- gpu-bench:begin -->", "<!-- gpu-bench:end -->")
LIVE_QUALITY = Section("<!-- live-quality:begin -->", "<!-- live-quality:end -->")
OWNED = (WHISPER, SOAK, GPU, LIVE_QUALITY)


def kept(text: str) -> str:
    """The owned sections of ``text``, to append to a re-rendered file."""
    return "".join("\n" + found + "\n" for s in OWNED if (found := s.find(text)) is not None)
