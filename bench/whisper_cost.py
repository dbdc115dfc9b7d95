"""What a Whisper step costs here: encoder time by frames and batch size, decoder
time per generated token, and what the online cost model learns from those steps.

    taskset -c 1 python -m bench.whisper_cost      # one core, Whisper base int8

Prints Markdown tables (docs/ARCHITECTURE.md quotes them). The audio is espeak-ng
speech repeated to length, so the decoder generates real text.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.audio import espeak_wav, read_wav
from engines.base import StepProfile
from engines.whisper import RATE, Job, WhisperEngine, as_float
from lanegate.settings import Settings
from lanes.cost import CostModel

ESPEAK_DEFAULT_WPM = 175  # what this bench measured with (espeak-ng's own default)
TEXT = "there is a lot of traffic on the road this morning. we have a lot of work to do"
SECONDS = (3, 6, 10, 16, 25)
BATCHES = (1, 2, 4)


def speech(seconds: float, tmp: Path) -> np.ndarray:
    one = as_float(read_wav(espeak_wav(TEXT, tmp / "s.wav", voice="en-us",
                                       wpm=ESPEAK_DEFAULT_WPM)))
    reps = int(np.ceil(seconds * RATE / len(one)))
    return np.tile(one, reps)[: int(seconds * RATE)]


def main() -> int:
    engine = WhisperEngine(Settings(data_dir=tempfile.mkdtemp(), cpu_threads=1), slots=1)
    cost = CostModel.from_prior(engine.cost_prior(), alpha=0.2)
    profiles: list[tuple[float, StepProfile]] = []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seconds in SECONDS:
            audio = speech(seconds, Path(tmp))
            cells = []
            for batch in BATCHES:
                t0 = time.perf_counter()
                engine.decode([Job(audio, "en") for _ in range(batch)])
                total = time.perf_counter() - t0
                p = engine.last_profile()
                assert p is not None
                profiles.append((total, p))
                cells.append(f"{p.encode_s * 1000:.0f} / {p.decode_s * 1000:.0f} "
                             f"({p.tokens} tok)")
            rows.append(f"| {seconds} s ({seconds * 100 + engine.pad_samples // 160} frames) | "
                        + " | ".join(cells) + " |")
    for total, p in profiles:
        cost.observe_profile(total, p)
    print(f"Whisper base {engine.compute_type}, {engine.cpu_threads} thread; "
          "encoder ms / decoder ms (decoder steps) per call")
    print("| segment | " + " | ".join(f"batch {b}" for b in BATCHES) + " |")
    print("|---|" + "---|" * len(BATCHES))
    print("\n".join(rows))
    r = cost.redecode
    assert r is not None
    print(f"\nlearned: encoder {r.encoder.coef[0]:.3f} s x kF + {r.encoder.coef[1]:.3f} s x kF^2 "
          f"per sequence; decoder {r.decoder.coef[0] * 1000:.0f} ms per sequence + "
          f"{r.decoder.coef[1] * 1000:.1f} ms per step; spread {cost.spread:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
