"""What the status page reads: this gateway's own histograms and each worker's
``/metrics``, as one ``Sample``; windows of two samples; percentiles of a window.

Histograms and counters are cumulative, so a window is the difference of two samples
(per lane and worker, summed per lane), and a percentile is Prometheus's
``histogram_quantile`` over the window's buckets.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from lanegate.histograms import histogram_quantile
from lanes.registry import WorkerInfo

#: families the gateway itself observes (``lane`` label only)
GATEWAY_FAMILIES = ("lanegate_partial_latency_seconds",)
#: families read from each worker's ``/metrics``
WORKER_FAMILIES = (
    "lanegate_step_duration_seconds",
    "lanegate_live_stall_seconds",
    "lanegate_long_prefill_seconds",  # a counter: its sample is ``..._total``
)

#: (family, lane, worker)
Key = tuple[str, str, str]
#: cumulative (upper bound, count) pairs, ascending, ending at +Inf
Buckets = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class Sample:
    t: float
    histograms: dict[Key, Buckets] = field(default_factory=dict)
    counters: dict[Key, float] = field(default_factory=dict)


def read_families(families: Iterable[Any], wanted: tuple[str, ...], worker: str,
                  into: Sample) -> None:
    """Add the buckets and counter totals of the ``wanted`` families to ``into``."""
    buckets: dict[Key, list[tuple[float, float]]] = {}
    for family in families:
        if family.name not in wanted:
            continue
        for sample in family.samples:
            lane = str(sample.labels.get("lane", ""))
            key = (family.name, lane, str(sample.labels.get("worker", worker)))
            if sample.name == family.name + "_bucket":
                buckets.setdefault(key, []).append((float(sample.labels["le"]),
                                                    float(sample.value)))
            elif sample.name == family.name + "_total":
                into.counters[key] = into.counters.get(key, 0.0) + float(sample.value)
    for key, pairs in buckets.items():
        into.histograms[key] = tuple(sorted(pairs))


async def scrape(http: aiohttp.ClientSession, worker: WorkerInfo, timeout_s: float,
                 into: Sample) -> bool:
    """Read one worker's ``/metrics`` into ``into``; False when it did not answer."""
    if not worker.url:
        return False
    try:
        async with http.get(worker.url.rstrip("/") + "/metrics",
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return False
            text = await resp.text()
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False
    read_families(text_string_to_metric_families(text), WORKER_FAMILIES, worker.worker_id,
                  into)
    return True


async def take_sample(http: aiohttp.ClientSession, workers: list[WorkerInfo],
                      timeout_s: float) -> tuple[Sample, list[str]]:
    """A sample of every source, and the ids of the workers that did not answer."""
    sample = Sample(t=time.time())
    read_families(REGISTRY.collect(), GATEWAY_FAMILIES, "gateway", sample)
    answered = await asyncio.gather(*(scrape(http, w, timeout_s, sample) for w in workers))
    silent = [w.worker_id for w, ok in zip(workers, answered, strict=True)
              if w.url and not ok]
    return sample, silent


@dataclass(frozen=True)
class Window:
    """What happened between two samples, per (family, lane)."""

    seconds: float
    histograms: dict[tuple[str, str], Buckets]
    counters: dict[tuple[str, str], float]

    def quantile_ms(self, family: str, lane: str, q: float) -> float | None:
        value = histogram_quantile(self.histograms.get((family, lane), ()), q)
        return None if value is None else round(value * 1000, 1)

    def count(self, family: str, lane: str) -> int:
        buckets = self.histograms.get((family, lane), ())
        return int(buckets[-1][1]) if buckets else 0

    def share(self, family: str, lane: str) -> float:
        """A seconds counter's increase per wall second (summed over the lane's workers)."""
        if self.seconds <= 0:
            return 0.0
        return self.counters.get((family, lane), 0.0) / self.seconds


def window(new: Sample, old: Sample | None, started: float) -> Window:
    """``new`` minus ``old`` (``None``: since ``started``, when every count was 0). A key
    whose counts went down restarted in between: its new counts are the window's."""
    histograms: dict[tuple[str, str], list[float]] = {}
    bounds: dict[tuple[str, str], list[float]] = {}
    for key, buckets in new.histograms.items():
        before = dict(old.histograms.get(key, ())) if old else {}
        counts = [c - before.get(le, 0.0) for le, c in buckets]
        if any(c < 0 for c in counts):
            counts = [c for _, c in buckets]
        lane_key = (key[0], key[1])
        if lane_key not in histograms:
            histograms[lane_key] = [0.0] * len(buckets)
            bounds[lane_key] = [le for le, _ in buckets]
        if len(histograms[lane_key]) == len(counts):
            histograms[lane_key] = [a + b for a, b in zip(histograms[lane_key], counts,
                                                          strict=True)]
    counters: dict[tuple[str, str], float] = {}
    for key, value in new.counters.items():
        before_value = old.counters.get(key, 0.0) if old else 0.0
        increase = value - before_value if value >= before_value else value
        lane_key = (key[0], key[1])
        counters[lane_key] = counters.get(lane_key, 0.0) + increase
    return Window(
        seconds=new.t - (old.t if old else started),
        histograms={k: tuple(zip(bounds[k], v, strict=True)) for k, v in histograms.items()},
        counters=counters,
    )


