"""Long speech without an endpoint: a two-voice espeak-ng dialogue and a monologue.

The dialogue's lines alternate two voices with short pauses (shorter than the VAD's
endpoint silence), so the whole exchange is one VAD segment until the max-window
cut; some lines repeat on purpose, as people do on a bad line. The monologue is one
paragraph said without a pause.
"""

from __future__ import annotations

import hashlib
import wave
from pathlib import Path

import numpy as np

from bench.audio import RATE, espeak_wav

VOICES = ("en-us+klatt", "en-us+f3")
PAUSE_S = 0.3  # between lines: under endpoint_silence_ms (600), one segment
WPM = 150

#: 16 lines, about 34 s with the pauses: longer than the 25 s max window
LINES = (
    "hello, can you hear me",
    "yes, i can hear you now",
    "do you hear me",
    "yes",
    "do you hear me",
    "yes",
    "good, the line was very bad this morning",
    "it was the rain, the cables got wet",
    "will they fix it before the weekend",
    "they said they would come on friday",
    "on friday",
    "on friday, in the afternoon",
    "then i will stay at home on friday",
    "thank you for calling",
    "are you still there",
    "yes, goodbye",
)

#: about 29 s of one voice without a pause: longer than the 25 s max window
MONOLOGUE = (
    "the old lighthouse stood at the end of the harbour wall and every evening the keeper "
    "climbed the narrow stairs to light the lamp while the fishing boats came home one by "
    "one across the grey water and the gulls followed them in circles crying over the nets "
    "until the last boat was tied up and the town grew quiet under the long summer sky "
    "and the children were called in from the beach for supper while their mothers "
    "lit the stoves in the small white houses along the shore"
)


def _espeak(text: str, voice: str, out: Path) -> np.ndarray:
    with wave.open(str(espeak_wav(text, out, voice=voice, wpm=WPM))) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
    out.unlink()
    return _trimmed(pcm)


def _trimmed(pcm: np.ndarray) -> np.ndarray:
    """The clip without espeak-ng's leading and trailing silence."""
    loud = np.flatnonzero(np.abs(pcm.astype(np.int32)) > 200)
    return pcm[loud[0] : loud[-1] + 1] if len(loud) else pcm


def _write(pcm: np.ndarray, out: Path) -> Path:
    with wave.open(str(out), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm.astype(np.int16).tobytes())
    return out


def dialogue(folder: Path, lines: tuple[str, ...] = LINES) -> Path:
    """The lines said in turn by two voices, ``PAUSE_S`` apart, as a 16 kHz WAV
    (cached by content)."""
    key = hashlib.sha1("|".join((*lines, *VOICES, str(PAUSE_S))).encode()).hexdigest()[:12]
    out = folder / f"dialogue-{key}.wav"
    if out.exists():
        return out
    gap = np.zeros(int(PAUSE_S * RATE), dtype=np.int16)
    parts: list[np.ndarray] = [np.zeros(RATE // 2, dtype=np.int16)]
    for i, line in enumerate(lines):
        parts += [_espeak(line, VOICES[i % 2], folder / f"line-{key}-{i}.wav"), gap]
    parts.append(np.zeros(RATE, dtype=np.int16))
    return _write(np.concatenate(parts), out)


def monologue(folder: Path, text: str = MONOLOGUE) -> Path:
    key = hashlib.sha1(text.encode()).hexdigest()[:12]
    out = folder / f"monologue-{key}.wav"
    if out.exists():
        return out
    pcm = _espeak(text, VOICES[0], folder / f"mono-{key}.wav")
    silence = np.zeros(RATE // 2, dtype=np.int16)
    return _write(np.concatenate([silence, pcm, silence, silence]), out)
