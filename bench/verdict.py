"""Verdicts from repeated rounds: a limit is judged on the median of the per-round figures.

Each round measures every design a target compares, one after another, so a ratio
is taken within one round (one moment of the machine) and then over the rounds.
The rule, also written in BENCHMARKS.md's method paragraph:

* ``met`` when every round meets the limit, ``missed`` when none does;
* when the rounds disagree, the median decides if it lies beyond the limit by more
  than the larger of two distances: the limit's margin (``UNSTABLE_MARGIN`` of the
  limit, or for a share that must reach ``L``, of what it may fall short by,
  ``1 - L``), and ``UNSTABLE_Z`` standard errors of the median, estimated from the
  rounds' own spread (:func:`median_error`); then ``met`` or ``missed``, otherwise
  ``unstable``. The second distance is for a noisy machine: rounds that spread
  wider than the margin leave the median where the next run's rounds may put it on
  the other side of the limit, and a verdict that the next run would contradict is
  not one. (It cannot make verdicts repeat: three rounds may all agree by chance.)

A scenario is missed if any of its checks is, else unstable if any is, else met.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

#: the live partial p99 a design must keep: the real-time red line, where the engine can
#: (pocketsphinx on a CPU core, any engine on a GPU) ...
RED_LINE_MS = 300.0
#: ... and Whisper base on a CPU core, which cannot: its re-decode of a live segment
#: alone takes longer than the red line there (BENCHMARKS.md's capacity part); the
#: Whisper benchmark's capacity and scenarios 1-2 on Whisper are judged against this
WHISPER_CPU_P99_MS = 1500.0
#: the share of the limit within which a median of disagreeing rounds is no verdict
UNSTABLE_MARGIN = 0.10
#: standard errors of the median within which a median of disagreeing rounds is no verdict
UNSTABLE_Z = 2.0
#: MAD x this estimates a normal spread's standard deviation
MAD_TO_SIGMA = 1.4826
#: the median's standard error over the mean's, for normal samples (sqrt(pi / 2))
MEDIAN_OVER_MEAN_ERROR = math.sqrt(math.pi / 2)


class Verdict(StrEnum):
    MET = "met"
    MISSED = "missed"
    UNSTABLE = "unstable"
    NOT_MEASURED = "not measured"


@dataclass(frozen=True)
class Check:
    """One limit a figure must keep in every round: ``value <= limit`` (``at_most``)
    or ``value >= limit``. ``share`` marks a fraction that must reach ``limit``: its
    margin is taken of ``1 - limit``, the room it has."""

    name: str
    limit: float
    at_most: bool = True
    share: bool = False

    def passes(self, value: float) -> bool:
        return value <= self.limit if self.at_most else value >= self.limit

    def margin(self, share_of_limit: float) -> float:
        room = 1.0 - self.limit if self.share else abs(self.limit)
        return share_of_limit * room

    @property
    def text(self) -> str:
        return f"{self.name} {'<=' if self.at_most else '>='} {self.limit:g}"


@dataclass(frozen=True)
class Rule:
    """How far a median of disagreeing rounds must lie from the limit to be a verdict:
    beyond ``margin`` (a share of the limit, see :meth:`Check.margin`) and beyond ``z``
    standard errors of the median. ``margin=inf``: every disagreement is unstable;
    ``z=0``: the margin alone decides."""

    margin: float = UNSTABLE_MARGIN
    z: float = UNSTABLE_Z

    def distance(self, check: Check, error: float) -> float:
        """How far from the limit a median with this standard ``error`` must lie."""
        return max(check.margin(self.margin), self.z * error)


def median_error(values: Sequence[float]) -> float:
    """The standard error of the median of ``values``, from their median absolute
    deviation (robust: one far-off round moves it little, two do)."""
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    mad = statistics.median(abs(v - mid) for v in values)
    return MAD_TO_SIGMA * mad * MEDIAN_OVER_MEAN_ERROR / math.sqrt(len(values))


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, min and max of the rounds that have a figure, and every round's figure."""
    got = [float(v) for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "rounds": list(values)}
    return {"median": statistics.median(got), "min": min(got), "max": max(got),
            "rounds": list(values)}


def judge(check: Check, values: Sequence[float | None],
          rule: Rule = Rule()) -> dict[str, Any]:
    """The check over the rounds; a round without the figure is left out. The result
    carries ``median_error`` (see :func:`median_error`) beside the median."""
    s = spread(values)
    got = [float(v) for v in values if v is not None]
    passed = sum(check.passes(v) for v in got)
    error = median_error(got)
    if not got:
        verdict = Verdict.NOT_MEASURED
    elif passed == len(got):
        verdict = Verdict.MET
    elif passed == 0:
        verdict = Verdict.MISSED
    else:
        verdict = _disagreeing(check, float(s["median"]), rule.distance(check, error))
    return {"check": check.text, **s, "median_error": error if got else None,
            "rounds_passed": passed, "rounds_measured": len(got), "verdict": verdict.value}


def _disagreeing(check: Check, median: float, distance: float) -> Verdict:
    beyond = median - check.limit if check.at_most else check.limit - median
    if beyond > distance:
        return Verdict.MISSED
    if beyond < -distance:
        return Verdict.MET
    return Verdict.UNSTABLE


def judge_flags(name: str, flags: Sequence[bool | None]) -> dict[str, Any]:
    """A yes/no condition per round (every stream served): all yes, all no, or unstable."""
    got = [f for f in flags if f is not None]
    passed = sum(got)
    verdict = (Verdict.NOT_MEASURED if not got else Verdict.MET if passed == len(got)
               else Verdict.MISSED if passed == 0 else Verdict.UNSTABLE)
    return {"check": name, "rounds": list(flags), "rounds_passed": passed,
            "rounds_measured": len(got), "verdict": verdict.value}


def combine(verdicts: Sequence[str]) -> Verdict:
    """A scenario's verdict from its checks' verdicts."""
    values = [Verdict(v) for v in verdicts]
    measured = [v for v in values if v is not Verdict.NOT_MEASURED]
    if not measured:
        return Verdict.NOT_MEASURED
    for worst in (Verdict.MISSED, Verdict.UNSTABLE):
        if worst in measured:
            return worst
    return Verdict.MET if len(measured) == len(values) else Verdict.NOT_MEASURED


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den
