"""The batch lane's ceiling: the raw pocketsphinx Decoder on the same audio, outside the service.

Run pinned to the batch worker's core: ``taskset -c 1 python -m bench.ceiling A.wav ...``.
``python -m bench.ceiling --stream A.wav SECONDS`` times the realtime lane's engine
work instead (100 ms chunks), and ``--spin SECONDS`` keeps a CPU busy with plain
interpreter work, for the cross-core interference check.
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
from engines.pocketsphinx import decoder_config
from lanegate.settings import Settings
from vad.segmenter import segment_pcm
from vad.settings import VadSettings


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


def measure_stream(path: Path, seconds: float) -> dict[str, float | int | str]:
    """The realtime lane's engine work alone: one stream decoder fed 100 ms chunks (no
    second pass), as many passes over the file as fit in ``seconds``; CPU s per audio s."""
    settings = Settings.from_env()
    decoder = Decoder(**decoder_config(settings, fwdflat=settings.ps_fwdflat))
    pcm = read_wav(path)
    chunk = RATE * 2 // 10
    utterance = RATE * 2 * 20  # restart the utterance every 20 s of audio, like an endpoint
    audio_s = wall = 0.0
    off = 0
    while wall < seconds:
        w0 = time.perf_counter()
        decoder.start_utt()
        for start in range(off, off + utterance, chunk):
            decoder.process_raw(pcm[start % len(pcm):start % len(pcm) + chunk], False, False)
        decoder.end_utt()
        wall += time.perf_counter() - w0
        audio_s += utterance / (RATE * 2)
        off = (off + utterance) % len(pcm)
    return {"audio_s": round(audio_s, 2), "wall_s": round(wall, 3),
            "wall_s_per_audio_s": round(wall / audio_s, 5),
            "cpus": ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))}


def spin(seconds: float) -> dict[str, float | int | str]:
    """Pure interpreter work with a tiny memory footprint: no cache or memory traffic to
    speak of, so a slowdown it causes on the other CPU means shared execution units."""
    deadline = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < deadline:
        for i in range(10_000):
            n += i * i
    return {"spin_s": seconds, "cpus": ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))}


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--spin":
        print(json.dumps(spin(float(argv[1]))))
        return 0
    if argv and argv[0] == "--stream":
        print(json.dumps(measure_stream(Path(argv[1]), float(argv[2]))))
        return 0
    print(json.dumps(measure([Path(p) for p in argv])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
