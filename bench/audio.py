"""Benchmark audio: real English speech from espeak-ng + sox, cached under bench/.work.

Everything is PCM s16le mono at 16 kHz. Live-stream clips are sentences with
pauses between them (so the VAD endpoints and finals happen); uploads are
minutes of the same kind of speech; a dump is speech of a given length.
A WAV given on the command line replaces the synthesized clip.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import wave
from pathlib import Path

import numpy as np

RATE = 16000
#: the shared human recording (44 s of a person reading, its transcript beside it as
#: ``two_cities.txt``): in ``shared/speech`` beside the checkout, or where
#: ``LANEGATE_SHARED_SPEECH`` (a directory) says
SHARED_SPEECH = Path(os.environ.get(
    "LANEGATE_SHARED_SPEECH", Path(__file__).resolve().parents[2] / "shared" / "speech")
) / "two_cities.wav"
BYTES_PER_S = RATE * 2
VOICE = "en-us+klatt"
WPM = 130

SENTENCES = (
    "The quarterly report shows that revenue grew by twelve percent this year.",
    "Please call me back when you have a moment to talk about the contract.",
    "The train to Boston leaves from platform four at half past nine.",
    "Our customer service line is open every day from eight until six.",
    "I would like to change the delivery address for my last order.",
    "The weather tomorrow will be cloudy with a chance of light rain.",
    "She opened the window and listened to the birds in the garden.",
    "Can you confirm the account number and the date of the last payment.",
    "The meeting has been moved to Thursday afternoon in the large room.",
    "We need three more volunteers to help with the charity event.",
    "He parked the car near the old bridge and walked to the market.",
    "The new software update fixes several problems with the printer.",
    "Thank you for waiting, an agent will be with you shortly.",
    "The museum is closed on Mondays but open late on Fridays.",
    "Remember to bring your passport and a copy of the booking.",
    "The children built a small boat out of wood and string.",
    "Interest rates are expected to stay the same until next spring.",
    "My flight was delayed by two hours because of the storm.",
    "The doctor said I should drink more water and sleep longer.",
    "Let us review the budget before we decide on the new hires.",
    "The kitchen needs a new table and four matching chairs.",
    "Traffic on the highway is moving slowly after an accident.",
    "I forgot my password and cannot log in to the website.",
    "The library will host a reading group every second Tuesday.",
)


def cache_dir(root: Path) -> Path:
    path = root / "audio"
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_wav(path: Path) -> bytes:
    """PCM s16le mono 16 kHz of a WAV file (converted with sox when it is not already)."""
    with wave.open(str(path)) as w:
        if (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2):
            return bytes(w.readframes(w.getnframes()))
    out = subprocess.run(
        ["sox", "-R", str(path), "-t", "raw", "-r", str(RATE), "-c", "1", "-b", "16",
         "-e", "signed-integer", "-"],
        check=True, capture_output=True,
    )
    return bytes(out.stdout)


def write_wav(path: Path, pcm: bytes) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm)
    return path


def espeak_wav(text: str, out: Path, *, voice: str = VOICE, wpm: int = WPM) -> Path:
    """``text`` spoken by espeak-ng, resampled by sox to a 16 kHz mono s16le WAV at
    ``out`` (``-R``: sox's dither seeded the same way, so the same text gives the same
    samples in every run)."""
    raw = out.with_suffix(".espeak.wav")
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(wpm), "-w", str(raw), text],
                   check=True, capture_output=True)
    subprocess.run(["sox", "-R", str(raw), "-r", str(RATE), "-c", "1", "-b", "16", str(out)],
                   check=True, capture_output=True)
    raw.unlink()
    return out


def synthesize(text: str, root: Path) -> bytes:
    """One sentence spoken by espeak-ng, resampled by sox; cached by text."""
    digest = hashlib.sha1(f"{text}|{VOICE}|{WPM}".encode()).hexdigest()[:16]
    out = cache_dir(root) / f"s-{digest}.wav"
    if not out.exists():
        espeak_wav(text, out)
    return read_wav(out)


def silence(seconds: float) -> bytes:
    return bytes(int(seconds * RATE) * 2)


def speech(seconds: float, root: Path, *, seed: int = 0, gap_s: float = 0.8) -> bytes:
    """At least ``seconds`` of sentences with pauses, cut to exactly that length."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(SENTENCES))
    parts: list[bytes] = []
    total = 0
    i = 0
    while total < seconds * BYTES_PER_S:
        part = synthesize(SENTENCES[int(order[i % len(order)])], root)
        part += silence(gap_s * float(rng.uniform(0.75, 1.5)))
        parts.append(part)
        total += len(part)
        i += 1
    pcm = b"".join(parts)
    return pcm[: int(seconds * RATE) * 2]


def upload_file(seconds: float, root: Path, index: int) -> Path:
    """A WAV of ``seconds`` of speech for the batch flood (cached)."""
    path = cache_dir(root) / f"upload-{int(seconds)}s-{index}.wav"
    if not path.exists():
        write_wav(path, speech(seconds, root, seed=1000 + index))
    return path
