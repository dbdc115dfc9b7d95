"""The batch lane's Whisper call against faster-whisper's own BatchedInferencePipeline
on the same recording, model, compute type and threads.

    taskset -c 1 python -m bench.whisper_batch_vs_faster RECORDING.wav [REFERENCE.txt] [--json]

lanegate: its decode windows (VAD segments joined up to ``batch_window_s``, 25 s) through
``WhisperEngine.transcribe_batch``, as a batch job's audio is decoded;
faster-whisper: ``BatchedInferencePipeline.transcribe`` (its Silero VAD), batch size 8,
greedy, word timestamps, language given, both in this process one after the other,
each with as many threads as the CPUs this process may run on (as the batch worker's
``cpu_threads = 0`` takes). With a reference text, each side's WER over the whole
recording. ``--json``: one JSON line (``bench.run``'s scenario 3 reads it) instead of
the human lines.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import wave
from typing import Any

import numpy as np
from faster_whisper import BatchedInferencePipeline, WhisperModel

from bench.wer import corpus_wer
from engines.whisper import WhisperEngine
from lanegate.settings import Settings
from lanes.job_audio import pcm_windows
from vad import VadSettings

#: faster-whisper's batch size, the batch lane's default ``whisper_batch_size`` too
BATCH_SIZE = 8


def batch_lane_engine(model: str, threads: int) -> WhisperEngine:
    """The batch lane's engine with ``threads`` threads and batches of ``BATCH_SIZE``."""
    return WhisperEngine(Settings(data_dir=tempfile.mkdtemp(), cpu_threads=threads,
                                  whisper_model=model, whisper_batch_size=BATCH_SIZE),
                         slots=1)


def measure(path: str, reference: str | None = None,
            model: str = "base") -> dict[str, Any]:
    """Both sides' wall time, audio seconds per wall second, words and WER."""
    with wave.open(path) as w:
        pcm = w.readframes(w.getnframes())
    duration = len(pcm) / 32000
    threads = len(os.sched_getaffinity(0))
    engine = batch_lane_engine(model, threads)
    started = time.perf_counter()
    settings = Settings()
    windows = pcm_windows(pcm, VadSettings.from_settings(settings), settings.batch_window_s)
    hyps = engine.transcribe_batch(windows)
    ours = time.perf_counter() - started
    our_text = " ".join(h.text for h in hyps)
    fw = WhisperModel(str(engine.model_dir), device="cpu", compute_type=engine.compute_type,
                      cpu_threads=threads)
    audio = np.frombuffer(pcm, np.int16).astype(np.float32) / 32768
    started = time.perf_counter()
    found, _ = BatchedInferencePipeline(fw).transcribe(
        audio, batch_size=BATCH_SIZE, language="en", word_timestamps=True, beam_size=1)
    found = list(found)  # the generator does the work
    theirs = time.perf_counter() - started
    their_text = " ".join(s.text for s in found)

    def side(wall: float, text: str, words: int) -> dict[str, Any]:
        return {"wall_s": round(wall, 3), "audio_s_per_wall_s": round(duration / wall, 3),
                "words": words,
                "wer": corpus_wer([(reference, text)]) if reference else None}

    return {"audio_s": round(duration, 2), "model": model, "compute_type": engine.compute_type,
            "threads": threads, "batch_size": BATCH_SIZE,
            "cpus": ",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
            "lanegate": side(ours, our_text, sum(len(h.words) for h in hyps)),
            "faster_whisper": side(theirs, their_text,
                                   sum(len(s.words or []) for s in found))}


def main(argv: list[str]) -> int:
    as_json = "--json" in argv
    args = [a for a in argv if a != "--json"]
    reference = open(args[1]).read() if len(args) > 1 else None  # noqa: SIM115
    m = measure(args[0], reference)
    if as_json:
        print(json.dumps(m))
        return 0
    ours, theirs = m["lanegate"], m["faster_whisper"]
    print(f"{m['audio_s']:.0f} s of audio, Whisper {m['model']} {m['compute_type']}, "
          f"{m['threads']} thread(s)")
    print(f"lanegate transcribe_batch: {ours['wall_s']:.1f} s, {ours['words']} words, "
          f"WER {ours['wer']}")
    print(f"BatchedInferencePipeline:  {theirs['wall_s']:.1f} s, {theirs['words']} words, "
          f"WER {theirs['wer']}")
    print(f"lanegate throughput / faster-whisper's: {theirs['wall_s'] / ours['wall_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
