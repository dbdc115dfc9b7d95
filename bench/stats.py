"""Percentiles of client samples, and step-duration histograms scraped from /metrics."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from lanegate.histograms import histogram_quantile

STEP_METRIC = "lanegate_step_duration_seconds"


def summary(samples: Sequence[float]) -> dict[str, float | int | None]:
    """count, p50, p95, p99, max, mean of ``samples`` (None when there are none)."""
    if not samples:
        return {"count": 0, "p50": None, "p95": None, "p99": None, "max": None, "mean": None}
    arr = np.asarray(samples, dtype=float)
    p50, p95, p99 = (float(np.percentile(arr, q)) for q in (50, 95, 99))
    return {"count": len(samples), "p50": round(p50, 2), "p95": round(p95, 2),
            "p99": round(p99, 2), "max": round(float(arr.max()), 2),
            "mean": round(float(arr.mean()), 2)}


@dataclass
class Histogram:
    """Cumulative bucket counts of one Prometheus histogram (upper bound -> count)."""

    buckets: dict[float, float]
    total: float  # sum of observed values

    @property
    def count(self) -> float:
        return self.buckets.get(math.inf, 0.0)

    def minus(self, earlier: Histogram) -> Histogram:
        return Histogram({le: c - earlier.buckets.get(le, 0.0) for le, c in self.buckets.items()},
                         self.total - earlier.total)

    def plus(self, other: Histogram) -> Histogram:
        keys = set(self.buckets) | set(other.buckets)
        return Histogram({le: self.buckets.get(le, 0.0) + other.buckets.get(le, 0.0)
                          for le in keys}, self.total + other.total)

    def quantile(self, q: float) -> float | None:
        """PromQL's histogram_quantile (``lanegate.histograms``, the status page's too)."""
        return histogram_quantile(sorted(self.buckets.items()), q)

    def max_bound(self) -> float | None:
        """The smallest bucket edge that holds every observation (the max is at most it)."""
        for le in sorted(self.buckets):
            if self.count > 0 and self.buckets[le] >= self.count:
                return None if math.isinf(le) else le
        return None

    def fraction_le(self, bound: float) -> float | None:
        """Share of observations at most ``bound`` (``bound`` must be a bucket edge)."""
        if self.count <= 0:
            return None
        return self.buckets.get(bound, 0.0) / self.count

    def to_json(self) -> dict[str, object]:
        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1000, 2)

        p50, p95, p99 = (self.quantile(q) for q in (0.5, 0.95, 0.99))
        return {
            "count": int(self.count),
            "mean_ms": ms(self.total / self.count) if self.count else None,
            "p50_ms": ms(p50), "p95_ms": ms(p95), "p99_ms": ms(p99),
            "share_le_50ms": self.fraction_le(0.05),
            "over_50ms": int(self.count - self.buckets.get(0.05, 0.0)),
            "max_at_most_ms": ms(self.max_bound()),
            "buckets": {("+Inf" if math.isinf(le) else repr(le)): int(c)
                        for le, c in sorted(self.buckets.items())},
        }


def parse_histograms(text: str, name: str = STEP_METRIC) -> dict[str, Histogram]:
    """Histograms named ``name`` in exposition ``text``, keyed by their ``lane`` label."""
    out: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name.removesuffix("_seconds") and family.name != name:
            continue
        for sample in family.samples:
            lane = sample.labels.get("lane", "")
            hist = out.setdefault(lane, Histogram({}, 0.0))
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                hist.buckets[le] = hist.buckets.get(le, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                hist.total += sample.value
    return out


def merge(hists: Iterable[Histogram]) -> Histogram:
    acc = Histogram({}, 0.0)
    for h in hists:
        acc = acc.plus(h)
    return acc
