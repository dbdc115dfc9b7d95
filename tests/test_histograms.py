"""One ``histogram_quantile`` (``lanegate/histograms.py``) for the status page and bench:
Prometheus's, edge for edge, so the status page, bench's reports and a Grafana panel on
the same buckets read the same figure."""

from __future__ import annotations

import math

import pytest

from bench.stats import Histogram
from gateway.status_sources import Window

INF = math.inf
#: cumulative (upper bound, count) pairs, sorted, +Inf last
SPREAD = ((0.1, 2.0), (0.2, 7.0), (0.5, 9.0), (INF, 10.0))
LATE_START = ((0.05, 0.0), (0.1, 0.0), (0.2, 4.0), (INF, 4.0))
CASES = [
    (SPREAD, 0.5, 0.1 + 0.1 * 3 / 5),   # linear inside the bucket that holds the rank
    (SPREAD, 0.2, 0.1),                  # a rank on a bucket's upper edge: that edge
    (SPREAD, 0.99, 0.5),                 # a rank in +Inf: the highest finite bound
    (((0.1, 50.0), (0.3, 90.0), (1.0, 100.0), (INF, 100.0)), 0.99, 0.3 + 0.7 * 0.9),
    (((0.1, 0.0), (INF, 5.0)), 0.99, 0.1),
    (LATE_START, 0.0, 0.1),              # q=0: the lower edge of the first bucket with any
    (LATE_START, 1.0, 0.2),
    (((0.1, 3.0), (0.2, 3.0), (INF, 3.0)), 1.0, 0.1),
]


def _window(buckets: tuple[tuple[float, float], ...]) -> Window:
    return Window(seconds=1.0, histograms={("step", "realtime"): buckets}, counters={})


@pytest.mark.parametrize(("buckets", "q", "expected"), CASES)
def test_the_status_page_and_bench_read_one_quantile(
        buckets: tuple[tuple[float, float], ...], q: float, expected: float) -> None:
    status_ms = _window(buckets).quantile_ms("step", "realtime", q)
    bench = Histogram(dict(buckets), total=0.0).quantile(q)
    assert status_ms == pytest.approx(round(expected * 1000, 1))
    assert bench == pytest.approx(expected)


def test_no_observations_is_no_quantile() -> None:
    assert _window(((0.1, 0.0), (INF, 0.0))).quantile_ms("step", "realtime", 0.5) is None
    assert _window(()).quantile_ms("step", "realtime", 0.5) is None
    assert Histogram({}, total=0.0).quantile(0.99) is None


def test_a_quantile_outside_0_to_1_is_refused() -> None:
    from lanegate.histograms import histogram_quantile

    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(SPREAD, 1.5)
    assert histogram_quantile(SPREAD, 0.5) == pytest.approx(0.16)
