"""Word error rate: a small normalizer and a Levenshtein distance over words.

The normalizer makes a reference and a hypothesis comparable the way WER
tools usually do: lower case, punctuation dropped (an apostrophe inside a word
kept), a range of numbers read as "to" ("3-5"), other hyphens as spaces, and
digits spelled out as words ("12" -> "twelve", "15th" -> "fifteenth"), since
Whisper writes numbers as digits and the references spell them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
        "eighteen", "nineteen")
TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")


def number_words(n: int) -> list[str]:
    """English words of ``0 <= n < 1_000_000``."""
    if n < 20:
        return [ONES[n]]
    if n < 100:
        return [TENS[n // 10]] + ([ONES[n % 10]] if n % 10 else [])
    if n < 1000:
        rest = number_words(n % 100) if n % 100 else []
        return [ONES[n // 100], "hundred", *rest]
    rest = number_words(n % 1000) if n % 1000 else []
    return [*number_words(n // 1000), "thousand", *rest]


#: the ordinal of a number's last word ("twenty five" -> "twenty fifth")
ORDINAL = {"one": "first", "two": "second", "three": "third", "five": "fifth",
           "eight": "eighth", "nine": "ninth", "twelve": "twelfth"}


def ordinal_words(n: int) -> list[str]:
    """English words of the ordinal ``n``th: 15 -> fifteenth, 21 -> twenty first."""
    words = number_words(n)
    last = words[-1]
    if last in ORDINAL:
        words[-1] = ORDINAL[last]
    elif last.endswith("y"):
        words[-1] = last[:-1] + "ieth"
    else:
        words[-1] = last + "th"
    return words


def normalize(text: str) -> list[str]:
    """The words of ``text`` as compared: lower case, no punctuation, numbers as words."""
    text = re.sub(r"(\d)\s*-\s*(\d)", r"\1 to \2", text.lower())  # a range: 3-5
    text = text.replace("-", " ").replace("%", " percent")
    text = re.sub(r"(\d),(\d)", r"\1\2", text)
    out: list[str] = []
    for token in re.findall(r"[a-z0-9']+", text):
        token = token.strip("'")
        if not token:
            continue
        ordinal = re.fullmatch(r"(\d{1,6})(st|nd|rd|th)", token)
        if ordinal:
            out += ordinal_words(int(ordinal.group(1)))
        elif token.isdigit() and len(token) <= 6:
            out += number_words(int(token))
        else:
            out += re.findall(r"[a-z']+|\d+", token)
    return out


def edit_distance(ref: Sequence[str], hyp: Sequence[str]) -> int:
    """Fewest substitutions, deletions and insertions that turn ``ref`` into ``hyp``."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i]
        for j, h in enumerate(hyp, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h)))
        prev = cur
    return prev[-1]


@dataclass(frozen=True)
class Score:
    errors: int
    words: int  # reference words

    @property
    def wer(self) -> float | None:
        return self.errors / self.words if self.words else None


def score(ref: str, hyp: str) -> Score:
    r = normalize(ref)
    return Score(edit_distance(r, normalize(hyp)), len(r))


def corpus_wer(pairs: Iterable[tuple[str, str]]) -> float | None:
    """WER over a corpus: all errors over all reference words (not a mean of ratios)."""
    scores = [score(ref, hyp) for ref, hyp in pairs]
    words = sum(s.words for s in scores)
    return round(sum(s.errors for s in scores) / words, 4) if words else None
