"""The engine alone, no service: each clip in one ``transcribe_batch`` call.

    taskset -c 1 python -m bench.raw_asr ENGINE MODEL CLIPS.json OUT.json

``ENGINE`` is ``whisper`` or ``pocketsphinx``; ``MODEL`` a ``whisper_model`` value
(ignored for pocketsphinx). CLIPS.json lists raw PCM paths; OUT.json gets one
hypothesis per clip and the seconds spent decoding. Run pinned, as the lane's worker is.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from engines import DecodeOptions, create_engine
from lanegate.settings import EngineName, Settings


def main(argv: list[str]) -> int:
    engine_name, model, clips_path, out_path = argv
    settings = Settings(engine=EngineName(engine_name), whisper_model=model)
    engine = create_engine(settings, slots=1)
    paths = json.loads(Path(clips_path).read_text())
    options = DecodeOptions(language="en")
    texts, audio_s, t0 = [], 0.0, time.perf_counter()
    for path in paths:
        pcm = Path(path).read_bytes()
        audio_s += len(pcm) / 32000
        texts.append(" ".join(h.text for h in engine.transcribe_batch([pcm], options)))
    wall = time.perf_counter() - t0
    Path(out_path).write_text(json.dumps({"texts": texts, "decode_s": round(wall, 2),
                                          "audio_s": round(audio_s, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
