"""The batch lane's Whisper call against faster-whisper's own BatchedInferencePipeline
on the same recording, model, compute type and threads.

    taskset -c 1 python -m bench.whisper_batch_vs_faster RECORDING.wav

lanegate: its VAD segments (at most 25 s) through ``WhisperEngine.transcribe_batch``;
faster-whisper: ``BatchedInferencePipeline.transcribe`` (its Silero VAD), batch size 8,
greedy, word timestamps, language given, both in this process one after the other.
"""

from __future__ import annotations

import sys
import tempfile
import time
import wave

import numpy as np
from faster_whisper import BatchedInferencePipeline, WhisperModel

from engines.whisper import WhisperEngine
from lanegate.settings import Settings
from vad import segment_pcm


def main(path: str) -> int:
    with wave.open(path) as w:
        pcm = w.readframes(w.getnframes())
    duration = len(pcm) / 32000
    engine = WhisperEngine(Settings(data_dir=tempfile.mkdtemp(), cpu_threads=1), slots=1)
    started = time.perf_counter()
    segments = [pcm[s.start * 2 : s.end * 2] for s in segment_pcm(pcm)]
    hyps = engine.transcribe_batch(segments)
    ours = time.perf_counter() - started
    words = sum(len(h.words) for h in hyps)
    model = WhisperModel(str(engine.model_dir), device="cpu", compute_type="int8",
                         cpu_threads=1)
    audio = np.frombuffer(pcm, np.int16).astype(np.float32) / 32768
    started = time.perf_counter()
    found, _ = BatchedInferencePipeline(model).transcribe(
        audio, batch_size=8, language="en", word_timestamps=True, beam_size=1)
    theirs_words = sum(len(s.words or []) for s in found)
    theirs = time.perf_counter() - started
    print(f"{duration:.0f} s of audio, Whisper base int8, 1 thread")
    print(f"lanegate transcribe_batch: {ours:.1f} s (RTF {ours / duration:.3f}), {words} words")
    print(f"BatchedInferencePipeline:  {theirs:.1f} s (RTF {theirs / duration:.3f}), "
          f"{theirs_words} words")
    print(f"lanegate throughput / faster-whisper's: {theirs / ours:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
