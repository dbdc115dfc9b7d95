"""The batch lane's WER and throughput against the span of audio one Whisper call sees.

    taskset -c 1 python -m bench.batch_windows RECORDING.wav REFERENCE.txt \\
        [--repeat 10] [--spans 0,20,22,25,28,29.9] [--out bench/results/batch_windows.json]

A sentence decoded alone loses the words around it ("spring" heard as "string" in
most repeats of the shared recording), so the batch lane joins consecutive webrtcvad
segments into decode windows of up to ``batch_window_s`` (25 s), as faster-whisper's
``BatchedInferencePipeline`` joins its VAD's speech into windows of up to 30 s. This
sweeps that length on the batch lane's own call, ``WhisperEngine.transcribe_batch`` (batch 8,
the bundled model, as many threads as the CPUs this process may run on), on the
recording repeated ``--repeat`` times, with its VAD segments joined into windows of at
most L seconds (``vad.decode_windows``, as the batch lane joins them) for each L of
``--spans`` (0: each segment alone): windows, audio seconds per wall second and WER,
one line each as it goes, all of them in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.audio import RATE, read_wav
from bench.wer import corpus_wer
from bench.whisper_batch_vs_faster import BATCH_SIZE, batch_lane_engine
from lanegate.constants import SAMPLE_WIDTH
from vad import decode_windows, segment_pcm


def measure(pcm: bytes, reference: str, spans_s: Sequence[float],
            model: str = "base") -> list[dict[str, Any]]:
    """One row per span: windows, their longest, wall time, throughput, words, WER."""
    engine = batch_lane_engine(model, len(os.sched_getaffinity(0)))
    duration = len(pcm) / SAMPLE_WIDTH / RATE
    segments = segment_pcm(pcm)
    rows: list[dict[str, Any]] = []
    for span_s in spans_s:
        windows = decode_windows(segments, round(span_s * RATE))
        started = time.perf_counter()
        hyps = engine.transcribe_batch([pcm[w.start * SAMPLE_WIDTH : w.end * SAMPLE_WIDTH]
                                        for w in windows])
        wall = time.perf_counter() - started
        rows.append({
            "span_s": span_s, "windows": len(windows),
            "longest_window_s": round(max(w.length for w in windows) / RATE, 2),
            "wall_s": round(wall, 3), "audio_s_per_wall_s": round(duration / wall, 2),
            "words": sum(len(h.words) for h in hyps),
            "wer": corpus_wer([(reference, " ".join(h.text for h in hyps))]),
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch_windows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recording", type=Path)
    p.add_argument("reference", type=Path)
    p.add_argument("--repeat", type=int, default=10,
                   help="the recording this many times end to end (default 10, 444 s of "
                        "the shared recording: scenario 3's flood upload)")
    p.add_argument("--spans", default="0,20,22,25,28,29.9",
                   help="comma list of the longest window, in seconds (0: no merging)")
    p.add_argument("--model", default="base")
    p.add_argument("--out", type=Path, default=Path("bench/results/batch_windows.json"))
    a = p.parse_args(argv)
    if a.repeat < 1:
        p.error("--repeat must be at least 1")
    spans = [float(x) for x in a.spans.split(",") if x.strip()]
    if not spans or any(not 0 <= s <= 30 for s in spans):
        p.error("--spans: seconds from 0 to 30 (Whisper hears at most 30 s at a time)")
    pcm = read_wav(a.recording) * a.repeat
    reference = " ".join([a.reference.read_text().strip()] * a.repeat)
    print(f"{len(pcm) / SAMPLE_WIDTH / RATE:.1f} s of audio, Whisper {a.model}, "
          f"{len(os.sched_getaffinity(0))} thread(s), batch {BATCH_SIZE}", flush=True)
    rows = measure(pcm, reference, spans, a.model)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "recording": a.recording.name, "repeat": a.repeat, "model": a.model,
        "cpus": ",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
        "batch_size": BATCH_SIZE, "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
