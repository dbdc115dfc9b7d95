"""``histogram_quantile``, as PromQL computes it, for everything that reads buckets.

The status page (``gateway/status_sources.py``) and bench's reports (``bench/stats.py``)
both read quantiles from scraped Prometheus histograms; this is their one definition,
so either agrees with a Grafana panel on the same buckets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: cumulative ``(upper bound, count)`` pairs, sorted by bound, the ``+Inf`` bucket last
Buckets = Sequence[tuple[float, float]]


def histogram_quantile(buckets: Buckets, q: float) -> float | None:
    """The ``q`` quantile (0-1) of cumulative buckets; ``None`` with no observations.

    As Prometheus: linear interpolation inside the bucket that holds the rank
    ``q x total``, from the bucket below's bound (0 for the first); a rank in the
    ``+Inf`` bucket is the highest finite bound. A bucket that holds no observations is
    never the answer (so ``q = 0`` is the lower edge of the first bucket with any).
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"a quantile is from 0 to 1, got {q!r}")
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count > below and count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower
