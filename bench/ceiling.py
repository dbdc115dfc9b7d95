"""The batch lane's ceiling: the raw pocketsphinx Decoder on the same audio, outside the service.

Run pinned to the batch worker's core: ``taskset -c 1 python -m bench.ceiling A.wav ...``.
It decodes exactly what the batch lane decodes (the same VAD segments, the
same decoder configuration, with the second pass) and prints one JSON line:
audio seconds per wall second over the whole files.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from pocketsphinx import Decoder

from bench.audio import RATE, read_wav
from lanegate.settings import Settings
from vad.segmenter import segment_pcm
from vad.settings import VadSettings
from workers.engines.pocketsphinx import decoder_config


def decode(decoder: Decoder, pcm: bytes) -> int:
    """Decode one utterance in 1 s pieces (as the batch engine feeds it); words found."""
    piece = RATE * 2
    decoder.start_utt()
    for off in range(0, len(pcm), piece):
        decoder.process_raw(pcm[off:off + piece], False, False)
    decoder.end_utt()
    return sum(1 for s in decoder.seg() if not s.word.startswith(("<", "[", "+")))


def measure(paths: list[Path]) -> dict[str, float | int | str]:
    settings = Settings.from_env()
    decoder = Decoder(**decoder_config(settings, fwdflat=True))
    vad = VadSettings.from_settings(settings)
    audio_s = speech_s = 0.0
    words = 0
    wall = cpu = 0.0
    for path in paths:
        pcm = read_wav(path)
        audio_s += len(pcm) / (RATE * 2)
        segments = [pcm[s.start * 2:s.end * 2] for s in segment_pcm(pcm, vad)]
        w0, c0 = time.perf_counter(), time.process_time()
        for seg in segments:
            words += decode(decoder, seg)
        wall += time.perf_counter() - w0
        cpu += time.process_time() - c0
        speech_s += sum(len(s) for s in segments) / (RATE * 2)
    return {"audio_s": round(audio_s, 2), "speech_s": round(speech_s, 2),
            "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "words": words,
            "audio_s_per_wall_s": round(audio_s / wall, 3),
            "cpus": ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))}


def main(argv: list[str]) -> int:
    print(json.dumps(measure([Path(p) for p in argv])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
