"""How much trailing silence a Whisper re-decode needs: WER and encoder time of
each espeak-ng sentence encoded with 0-2 s of silence after it, or padded to 30 s.

    taskset -c 1 python -m bench.whisper_padding   # one core, Whisper base int8

Prints one Markdown table (docs/ARCHITECTURE.md quotes it).
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.audio import espeak_wav, read_wav
from engines.whisper import MAX_FRAMES, RATE, Job, WhisperEngine, as_float
from lanegate.settings import Settings

SENTENCES = (
    "there is a lot of traffic on the road this morning",
    "i don't know what you are talking about",
    "it will rain again tomorrow afternoon",
    "the people in the city are very friendly",
    "we have a lot of work to do this week",
    "she bought a new car last summer and drove it to the coast",
)
VOICES = (("en-us+klatt", 130), ("en-us", 175), ("en-gb", 150))
PADS_S = (0.0, 0.5, 1.0, 2.0, 3.0, None)  # None: padded to Whisper's 30 s window


def speak(text: str, voice: str, wpm: int, out: Path) -> bytes:
    return read_wav(espeak_wav(text, out, voice=voice, wpm=wpm))


def norm(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def wer(ref: str, hyp: str) -> tuple[int, int]:
    r, h = norm(ref), norm(hyp)
    d = np.arange(len(h) + 1)
    for i, rw in enumerate(r, 1):
        prev, d[0] = d.copy(), i
        for j, hw in enumerate(h, 1):
            d[j] = min(prev[j] + 1, d[j - 1] + 1, prev[j - 1] + (rw != hw))
    return int(d[len(h)]), len(r)


def main() -> int:
    engine = WhisperEngine(Settings(data_dir=tempfile.mkdtemp(), cpu_threads=1), slots=1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        clips = [(text, speak(text, v, wpm, Path(tmp) / f"{i}-{k}.wav"))
                 for i, text in enumerate(SENTENCES) for k, (v, wpm) in enumerate(VOICES)]
        for pad in PADS_S:
            errors = words = 0
            enc = total = 0.0
            for text, pcm in clips:
                audio = as_float(pcm)
                engine.pad_samples = (MAX_FRAMES * RATE // 100 - len(audio)) if pad is None \
                    else int(pad * RATE)
                t0 = time.perf_counter()
                decoded = engine.decode([Job(audio, "en")])[0]
                total += time.perf_counter() - t0
                profile = engine.last_profile()
                enc += profile.encode_s if profile else 0.0
                e, n = wer(text, engine.tokenizer("en").decode(decoded.tokens))
                errors, words = errors + e, words + n
            label = "30 s window" if pad is None else f"+{pad:.1f} s"
            rows.append(f"| {label} | {errors / words:.3f} | {enc / len(clips) * 1000:.0f} | "
                        f"{total / len(clips) * 1000:.0f} |")
    print(f"{len(clips)} clips ({len(SENTENCES)} sentences x {len(VOICES)} voices), "
          f"Whisper base {engine.compute_type}, {engine.cpu_threads} thread")
    print("| trailing silence encoded | WER | encoder ms / clip | decode ms / clip |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
