"""LocalAgreement-2: what of a re-decoded hypothesis is stable enough to show.

A streaming re-decoder (Whisper re-decodes its whole current segment every step)
changes its mind about the last words as more audio comes. A word is committed
once two consecutive hypotheses agree on it and on everything before it (the
longest common prefix of the last two), and the last word of the newest
hypothesis is never committed (it may be cut mid-word at the edge of the audio). Committed
words never change, so partial text only grows.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field


def comparable(word: str) -> str:
    """A word as agreement compares it: case, accents kept; punctuation and spaces not."""
    kept = "".join(ch for ch in word.strip() if not unicodedata.category(ch).startswith("P"))
    return kept.lower()


def common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common prefix of two word lists (compared loosely)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if comparable(x) != comparable(y):
            break
        n += 1
    return n


@dataclass
class LocalAgreement:
    """Committed words of one segment, grown by each new hypothesis."""

    committed: int = 0  # words of the current hypothesis that are committed
    _previous: list[str] = field(default_factory=list)

    def update(self, words: Sequence[str], eligible: int | None = None) -> int:
        """Take the next hypothesis (its words); return how many of them are committed.

        ``eligible`` caps what may be committed now (the words far enough from the
        edge of the audio). The committed count never shrinks while the hypothesis
        keeps the committed words (a decoder forced to start with them always does).
        """
        stable = min(common_prefix(self._previous, words), len(words) - 1,
                     len(words) if eligible is None else eligible)
        self.committed = max(self.committed, stable)
        self.committed = min(self.committed, len(words))
        self._previous = list(words)
        return self.committed

    def reset(self) -> None:
        self.committed = 0
        self._previous = []
