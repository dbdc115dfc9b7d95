"""PNG plots from results.json: latency CDFs, step-duration histograms, stalls over time."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, NullFormatter

PLAIN = FuncFormatter(lambda v, _pos: f"{v:g}")

GROUPS = (  # (title, [(results key, label)])
    ("1: {n} live streams + batch flood (pocketsphinx)",
     [("s1_alone", "alone"), ("s1_split", "split + flood"), ("s1_mixed", "mixed + flood")]),
    ("2: {n} live streams + buffered dumps (pocketsphinx)",
     [("s2_split", "split (cap)"), ("s2_split_nocap", "split-nocap")]),
    ("4: {n} streams + long prefills (simulated)",
     [("s4_sim-cap", "cap"), ("s4_sim-nocap", "no cap")]),
    ("5: {n} streams, gateway overhead (simulated)",
     [("s5_direct", "direct to workers"), ("s5_via_gateway", "through the gateway")]),
    ("5 (light): {n} streams, gateway overhead (simulated)",
     [("s5_light_direct", "direct to workers"),
      ("s5_light_via_gateway", "through the gateway")]),
)
RED_LINE_MS = 300.0


def _present(r: dict[str, Any]) -> list[tuple[str, list[tuple[str, str]]]]:
    out = []
    for title, items in GROUPS:
        keys = [(k, lbl) for k, lbl in items if k in r]
        if keys:
            out.append((title.format(n=r[keys[0][0]]["live_streams"]), keys))
    return out


def _grid(n: int) -> tuple[Any, list[Any]]:
    cols = 2 if n > 1 else 1
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def latency_cdf(r: dict[str, Any], path: Path) -> None:
    """Partial-latency CDF per design; the y axis is logit so the p99 tail is visible."""
    groups = _present(r)
    fig, axes = _grid(len(groups))
    for ax, (title, items) in zip(axes, groups, strict=True):
        for key, label in items:
            points = [(q / 100, v) for q, v in r[key]["partial_cdf_ms"] if 0 < q < 100]
            if not points:
                continue
            p99 = r[key]["partial_ms"]["p99"]
            n = r[key]["partial_ms"]["count"]
            ax.plot([max(v, 0.1) for _, v in points], [q for q, _ in points],
                    label=f"{label}: p99 {p99:.0f} ms (n={n})")
        ax.axvline(RED_LINE_MS, color="red", linestyle="--", linewidth=1, label="300 ms")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(PLAIN)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yscale("logit")
        ax.set_yticks([0.1, 0.5, 0.9, 0.99, 0.999])
        ax.set_yticklabels(["p10", "p50", "p90", "p99", "p99.9"])
        ax.set_xlabel("partial latency (ms, log)")
        ax.set_ylabel("percentile")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bucket_fractions(buckets: dict[str, int]) -> tuple[list[str], list[float]]:
    """Non-cumulative share of steps per bucket, labelled by upper bound in ms."""
    edges = sorted(buckets, key=lambda k: math.inf if k == "+Inf" else float(k))
    total = buckets.get("+Inf", 0) or 1
    labels, shares, prev = [], [], 0
    for e in edges:
        labels.append("inf" if e == "+Inf" else f"{float(e) * 1000:g}")
        shares.append(100 * (buckets[e] - prev) / total)
        prev = buckets[e]
    return labels, shares


def _steps(res: dict[str, Any]) -> dict[str, Any]:
    steps: dict[str, Any] = res.get("steps", {})
    return steps.get("realtime") or steps.get("mixed") or {}


def step_histogram(r: dict[str, Any], path: Path) -> None:
    groups = [(t, [(k, lbl) for k, lbl in items if _steps(r[k]).get("count")])
              for t, items in _present(r)]
    groups = [g for g in groups if g[1]]
    if not groups:
        return
    fig, axes = _grid(len(groups))
    for ax, (title, items) in zip(axes, groups, strict=True):
        width = 0.8 / len(items)
        for i, (key, label) in enumerate(items):
            st = _steps(r[key])
            labels, shares = _bucket_fractions(st["buckets"])
            xs = [x + i * width for x in range(len(labels))]
            ax.bar(xs, shares, width=width, label=f"{label} (n={st['count']})")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
        ax.set_xticklabels(labels, rotation=60, fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("step duration bucket, upper bound (ms)")
        ax.set_ylabel("% of steps (log)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline(r: dict[str, Any], path: Path) -> None:
    groups = [g for g in _present(r) if g[0][0] in "124"]
    if not groups:
        return
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 2.6 * len(groups)), squeeze=False)
    for ax, (title, items) in zip(axes[:, 0], groups, strict=True):
        for key, label in items:
            tl = r[key]["timeline_worst_ms"]
            ax.plot([t for t, _ in tl], [max(v, 0.1) for _, v in tl], label=label,
                    linewidth=1)
        ax.axhline(RED_LINE_MS, color="red", linestyle="--", linewidth=1, label="300 ms")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(PLAIN)
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("worst partial (ms)")
        ax.set_title(title + ": worst partial latency per 0.5 s", fontsize=10)
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(True, which="both", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds into the window")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_all(doc: dict[str, Any], out: Path) -> list[Path]:
    r = doc["results"]
    paths = [out / "latency_cdf.png", out / "step_histogram.png", out / "timeline.png"]
    latency_cdf(r, paths[0])
    step_histogram(r, paths[1])
    timeline(r, paths[2])
    return [p for p in paths if p.exists()]
