"""How fast the VAD segments audio: an hour of speech, pushed in 100 ms chunks, on one core.

Run: ``python -m bench.vad_speed [seconds]`` prints JSON
``{"audio_s", "wall_s", "x_realtime", "segments", "soft_cuts"}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np
import numpy.typing as npt

from vad import SegmentEnded, StreamingSegmenter, VadSettings

RATE = 16000
CHUNK_MS = 100
SENTENCES = (
    "The quarterly numbers look better than we expected at the start of the year",
    "Could you send the contract to the legal team before Friday afternoon",
    "We will move the launch to next month so that support has time to prepare",
    "Thanks everyone, let us take the remaining questions at the end of the call",
    "The network upgrade finished overnight and nobody noticed any downtime",
    "Our customers in Europe asked for the invoices in their own currency",
)

Pcm = npt.NDArray[np.int16]


def synthesize(text: str, workdir: Path) -> Pcm:
    raw, out = workdir / "raw.wav", workdir / "out.wav"
    subprocess.run(
        ["espeak-ng", "-v", "en-us+klatt", "-s", "130", "-w", str(raw), text],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        ["sox", "-R", str(raw), "-r", str(RATE), "-c", "1", "-b", "16", str(out)],
        check=True,
        capture_output=True,
    )
    with wave.open(str(out)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)


def brown_noise(n: int, rng: np.random.Generator, rms: float) -> npt.NDArray[np.float64]:
    x = np.cumsum(rng.standard_normal(n))
    x -= np.convolve(x, np.ones(401) / 401, mode="same")  # keep the walk from drifting away
    return x * (rms / (x.std() or 1.0))


def base_clip() -> Pcm:
    """About two minutes: sentences with pauses in room tone, then a long run of
    unpaused speech under a fan loud enough that the max-window cut must act."""
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        speech = [synthesize(t, Path(tmp)) for t in SENTENCES]
    paused: list[Pcm] = []
    for s in speech * 3:
        paused += [s, np.zeros(int(RATE * rng.uniform(0.3, 1.5)), dtype=np.int16)]
    quiet = np.concatenate(paused).astype(np.float64)
    quiet += brown_noise(len(quiet), rng, 30.0)
    loud = np.concatenate(speech * 3).astype(np.float64)
    loud += brown_noise(len(loud), rng, 1500.0)
    x = np.concatenate([quiet, loud])
    out: Pcm = np.clip(x, -32768, 32767).astype(np.int16)
    return out


def pin_to_one_core() -> set[int] | None:
    """Pin this process to the core it runs on; returns the old affinity to restore."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(old)})
    return old


def measure_vad_speed(seconds: float = 3600.0) -> dict[str, float]:
    chunk_bytes = RATE * CHUNK_MS // 1000 * 2
    clip = base_clip().tobytes()
    clip = clip[: len(clip) // chunk_bytes * chunk_bytes]
    # The hour is the clip tiled; its chunks are sliced once and pushed in a cycle.
    pieces = [clip[i : i + chunk_bytes] for i in range(0, len(clip), chunk_bytes)]
    n_chunks = max(1, round(seconds * 1000 / CHUNK_MS))
    old = pin_to_one_core()
    try:
        seg = StreamingSegmenter(VadSettings())
        segments = soft_cuts = 0
        t0 = time.perf_counter()
        for i in range(n_chunks):
            for e in seg.push(pieces[i % len(pieces)]):
                if isinstance(e, SegmentEnded):
                    segments += 1
                    soft_cuts += e.reason == "max_window"
        segments += sum(isinstance(e, SegmentEnded) for e in seg.flush())
        wall = time.perf_counter() - t0
    finally:
        if old is not None:
            os.sched_setaffinity(0, old)
    audio_s = n_chunks * CHUNK_MS / 1000
    return {
        "audio_s": audio_s,
        "wall_s": wall,
        "x_realtime": audio_s / wall,
        "segments": float(segments),
        "soft_cuts": float(soft_cuts),
    }


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3600.0
    print(json.dumps(measure_vad_speed(seconds)))


if __name__ == "__main__":
    main()
