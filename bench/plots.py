"""PNG plots from results.json: latency CDFs, step-duration histograms, stalls over time."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, NullFormatter

from bench import report

PLAIN = FuncFormatter(lambda v, _pos: f"{v:g}")

GROUPS = (  # (title, [(results key, label)])
    ("1: {n} live streams + batch flood ({engine})",
     [("s1_alone", "alone"), ("s1_split", "split + flood"), ("s1_mixed", "mixed + flood")]),
    ("2: {n} live streams + buffered dumps ({engine})",
     [("s2_split", "split (cap)"), ("s2_split_nocap", "split-nocap")]),
    ("4: {n} streams + long prefills (simulated)",
     [("s4_sim-cap", "cap"), ("s4_sim-nocap", "no cap")]),
)
RED_LINE_MS = 300.0
Rounds = list[dict[str, Any]]  # each round's windows


def _groups(doc: dict[str, Any]) -> list[tuple[str, list[tuple[str, str]]]]:
    loads = report.scale_loads(doc)
    return [*GROUPS, *((f"5: {n} streams, gateway overhead (simulated)",
                        [(f"s5_{n}_direct", "direct to workers"),
                         (f"s5_{n}_via_gateway", "through the gateway")]) for n in loads)]


def _present(doc: dict[str, Any], ws: Rounds) -> list[tuple[str, list[tuple[str, str]]]]:
    out = []
    for title, items in _groups(doc):
        keys = [(k, lbl) for k, lbl in items if any(k in w for w in ws)]
        if keys:
            first = next(w[keys[0][0]] for w in ws if keys[0][0] in w)
            out.append((title.format(n=first["live_streams"],
                                     engine=report.engine_of(doc["options"])), keys))
    return out


def _grid(n: int) -> tuple[Any, list[Any]]:
    cols = 2 if n > 1 else 1
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def latency_cdf(doc: dict[str, Any], ws: Rounds, path: Path) -> None:
    """Partial-latency CDF per design, one line per round (the spread is the bundle);
    the y axis is logit so the p99 tail is visible."""
    groups = _present(doc, ws)
    if not groups:
        return
    fig, axes = _grid(len(groups))
    for ax, (title, items) in zip(axes, groups, strict=True):
        for i, (key, label) in enumerate(items):
            color = f"C{i}"
            p99s = [w[key]["partial_ms"]["p99"] for w in ws if key in w]
            stalls = sum(int(w[key].get("stalled_streams", 0)) for w in ws if key in w)
            stalled = f", {stalls} stalled (counted at the window)" if stalls else ""
            for k, w in enumerate(ws):
                points = [(q / 100, v) for q, v in w.get(key, {}).get("partial_cdf_ms", [])
                          if 0 < q < 100]
                if points:
                    ax.plot([max(v, 0.1) for _, v in points], [q for q, _ in points],
                            color=color, alpha=0.8, linewidth=1,
                            label=None if k else f"{label}: p99 "
                            f"{'/'.join(f'{v:.0f}' for v in p99s if v is not None)} ms"
                            f"{stalled}")
        ax.axvline(RED_LINE_MS, color="red", linestyle="--", linewidth=1, label="300 ms")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(PLAIN)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yscale("logit")
        ax.set_yticks([0.1, 0.5, 0.9, 0.99, 0.999])
        ax.set_yticklabels(["p10", "p50", "p90", "p99", "p99.9"])
        ax.set_xlabel("partial latency (ms, log)")
        ax.set_ylabel("percentile")
        ax.set_title(title + " (one line per round)", fontsize=10)
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


def _summed_buckets(ws: Rounds, key: str) -> dict[str, int]:
    """A design's step histogram over every round."""
    out: dict[str, int] = {}
    for w in ws:
        for edge, count in _steps(w.get(key, {})).get("buckets", {}).items():
            out[edge] = out.get(edge, 0) + count
    return out


def step_histogram(doc: dict[str, Any], ws: Rounds, path: Path) -> None:
    groups = [(t, [(k, lbl) for k, lbl in items if _summed_buckets(ws, k).get("+Inf")])
              for t, items in _present(doc, ws)]
    groups = [g for g in groups if g[1]]
    if not groups:
        return
    fig, axes = _grid(len(groups))
    for ax, (title, items) in zip(axes, groups, strict=True):
        width = 0.8 / len(items)
        labels: list[str] = []
        for i, (key, label) in enumerate(items):
            buckets = _summed_buckets(ws, key)
            labels, shares = _bucket_fractions(buckets)
            xs = [x + i * width for x in range(len(labels))]
            ax.bar(xs, shares, width=width, label=f"{label} (n={buckets['+Inf']})")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
        ax.set_xticklabels(labels, rotation=60, fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("step duration bucket, upper bound (ms)")
        ax.set_ylabel("% of steps (log)")
        ax.set_title(title + " (all rounds)", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline(doc: dict[str, Any], ws: Rounds, path: Path) -> None:
    groups = [g for g in _present(doc, ws) if g[0][0] in "124"]
    if not groups or not ws:
        return
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 2.6 * len(groups)), squeeze=False)
    for ax, (title, items) in zip(axes[:, 0], groups, strict=True):
        for key, label in items:
            tl = ws[0].get(key, {}).get("timeline_worst_ms", [])
            ax.plot([t for t, _ in tl], [max(v, 0.1) for _, v in tl], label=label,
                    linewidth=1)
        ax.axhline(RED_LINE_MS, color="red", linestyle="--", linewidth=1, label="300 ms")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(PLAIN)
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("worst partial (ms)")
        ax.set_title(title + ": worst partial latency per 0.5 s, round 1", fontsize=10)
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(True, which="both", alpha=0.3)
    axes[-1, 0].set_xlabel("seconds into the window")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rounds_plot(doc: dict[str, Any], path: Path) -> None:
    """Every check's figure in each round (markers), its median and its limit, and the
    machine's probe time per round: which rounds ran on a slow machine."""
    checks = [(key, c) for key, v in doc["verdicts"].items() for c in v["checks"]
              if "median" in c and c["median"] is not None]
    rounds = doc["results"].get("rounds", [])
    if not checks or not rounds:
        return
    fig, axes = _grid(len(checks) + 1)
    for ax, (key, c) in zip(axes, checks, strict=False):
        xs = [i + 1 for i, v in enumerate(c["rounds"]) if v is not None]
        ys = [v for v in c["rounds"] if v is not None]
        ax.plot(xs, ys, "o", label="rounds")
        ax.axhline(c["median"], color="black", linestyle=":", linewidth=1,
                   label=f"median {c['median']:.3g}")
        name, op, limit = c["check"].rsplit(" ", 2)
        ax.axhline(float(limit), color="red", linestyle="--", linewidth=1,
                   label=f"limit {op} {limit}")
        ax.set_title(f"{key[1:]}: {name} → {c['verdict']}", fontsize=9)
        ax.set_xlabel("round")
        ax.set_xticks(range(1, len(rounds) + 1))
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    ax = axes[-1]
    for part in rounds[0]["machine"]:
        probes = [rnd["machine"].get(part, {}).get("probe_s") for rnd in rounds]
        xs = [i + 1 for i, p in enumerate(probes) if p]
        ax.plot(xs, [max(p) for p in probes if p], "v", label=f"{part} (slower probe)")
    ax.set_title("machine: probe loop seconds (higher = slower)", fontsize=9)
    ax.set_xlabel("round")
    ax.set_xticks(range(1, len(rounds) + 1))
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_all(doc: dict[str, Any], out: Path) -> list[Path]:
    ws = report.round_windows(doc)
    paths = [out / "latency_cdf.png", out / "step_histogram.png", out / "timeline.png",
             out / "rounds.png"]
    for p in paths:
        p.unlink(missing_ok=True)  # a plot this run has nothing for must not stay behind
    latency_cdf(doc, ws, paths[0])
    step_histogram(doc, ws, paths[1])
    timeline(doc, ws, paths[2])
    rounds_plot(doc, paths[3])
    return [p for p in paths if p.exists()]
