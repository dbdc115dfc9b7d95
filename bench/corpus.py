"""The accuracy corpus: sentences with known text, spoken by espeak-ng in several voices
and rates, clean and with noise mixed in at a fixed SNR; and live clips (sentences with
pauses) whose reference is the text of the sentences in them.

Everything is PCM s16le mono 16 kHz, cached under the work directory by content.
"""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.audio import RATE, SENTENCES, cache_dir, espeak_wav, read_wav, silence

#: sentences of the accuracy corpus: the live clips' 24 plus these
EXTRA = (
    "There is a lot of traffic on the road this morning.",
    "I don't know what you are talking about.",
    "It will rain again tomorrow afternoon.",
    "The people in the city are very friendly.",
    "We have a lot of work to do this week.",
    "She bought a new car last summer and drove it to the coast.",
    "The package should arrive within three to five working days.",
    "Please hold the line while I transfer you to the billing department.",
    "The hotel offers free breakfast and a shuttle to the airport.",
    "Turn left at the second light and the bank is on your right.",
    "The concert starts at seven, so we should leave by six.",
    "Your appointment with the dentist is on the fifteenth of May.",
)
CORPUS = SENTENCES + EXTRA


@dataclass(frozen=True)
class Condition:
    """How a clip is spoken: espeak-ng voice and rate (words per minute), and the SNR of
    pink noise mixed in (None: clean)."""

    voice: str
    wpm: int
    snr_db: float | None = None

    @property
    def name(self) -> str:
        noise = f"+noise{self.snr_db:g}dB" if self.snr_db is not None else ""
        return f"{self.voice}@{self.wpm}{noise}"


#: the accuracy table's rows: voices, rates, noise
CONDITIONS = (
    Condition("en-us", 140), Condition("en-us", 175), Condition("en-us", 210),
    Condition("en", 175), Condition("en+f3", 175), Condition("en-us+klatt", 140),
    Condition("en-us", 175, 10.0),
)


@dataclass(frozen=True)
class Clip:
    condition: str
    text: str  # the reference
    path: Path  # raw PCM


def speak(text: str, voice: str, wpm: int, root: Path) -> bytes:
    """One sentence by espeak-ng, resampled to 16 kHz mono by sox; cached."""
    digest = hashlib.sha1(f"{text}|{voice}|{wpm}".encode()).hexdigest()[:16]
    out = cache_dir(root) / f"c-{digest}.wav"
    if not out.exists():
        espeak_wav(text, out, voice=voice, wpm=wpm)
    return read_wav(out)


def pink_noise(seconds: float, seed: int, root: Path) -> np.ndarray:
    """Pink noise made by sox (``synth pinknoise``), as float samples."""
    out = cache_dir(root) / f"pink-{seconds:.2f}-{seed}.raw"
    if not out.exists():
        subprocess.run(["sox", "-R", "-n", "-r", str(RATE), "-c", "1", "-b", "16",
                        "-e", "signed-integer", "-t", "raw", str(out),
                        "synth", f"{seconds:.3f}", "pinknoise", "vol", "0.5"],
                       check=True, capture_output=True)
    noise = np.frombuffer(out.read_bytes(), dtype=np.int16).astype(np.float64)
    return np.roll(noise, seed * 997)


def mix(pcm: bytes, snr_db: float, seed: int, root: Path) -> bytes:
    """``pcm`` with pink noise at ``snr_db`` (speech RMS over the whole clip / noise RMS)."""
    speech = np.frombuffer(pcm, dtype=np.int16).astype(np.float64)
    noise = pink_noise(len(speech) / RATE + 0.1, seed, root)[: len(speech)]
    gain = np.sqrt(np.mean(speech**2)) / (np.sqrt(np.mean(noise**2)) * 10 ** (snr_db / 20))
    out = np.clip(speech + gain * noise, -32768, 32767)
    return bytes(out.astype(np.int16).tobytes())


def render(text: str, cond: Condition, seed: int, root: Path) -> bytes:
    pcm = speak(text, cond.voice, cond.wpm, root)
    return mix(pcm, cond.snr_db, seed, root) if cond.snr_db is not None else pcm


def clips(root: Path, per_condition: int,
          conditions: tuple[Condition, ...] = CONDITIONS) -> list[Clip]:
    """``per_condition`` sentences in each condition, a different run of the corpus for
    each so that the table covers every sentence."""
    out = []
    for k, cond in enumerate(conditions):
        for j in range(per_condition):
            index = (k * per_condition + j) % len(CORPUS)
            text = CORPUS[index]
            path = cache_dir(root) / f"clip-{cond.name}-{index}.pcm"
            if not path.exists():
                path.write_bytes(render(text, cond, index, root))
            out.append(Clip(cond.name, text, path))
    return out


def joined(clip_list: list[Clip], gap_s: float, root: Path, name: str) -> tuple[Path, str]:
    """The clips one after the other with ``gap_s`` of silence after each (so the VAD
    ends an utterance after each): a PCM file and its reference text."""
    path = cache_dir(root) / f"{name}.pcm"
    pcm = b"".join(c.path.read_bytes() + silence(gap_s) for c in clip_list)
    path.write_bytes(pcm)
    return path, " ".join(c.text for c in clip_list)


def live_clip(seconds: float, seed: int, root: Path,
              cond: Condition = Condition("en-us", 175)) -> tuple[Path, str, float]:
    """Sentences with 1 s pauses, at least ``seconds`` long, in a seeded order: a live
    stream's audio, its reference text and its length in seconds."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(CORPUS))
    parts, texts, total, i = [], [], 0, 0
    while total < seconds * RATE * 2:
        text = CORPUS[int(order[i % len(order)])]
        part = render(text, cond, i, root) + silence(1.0)
        parts.append(part)
        texts.append(text)
        total += len(part)
        i += 1
    path = cache_dir(root) / f"live-{cond.name}-{int(seconds)}s-{seed}.pcm"
    path.write_bytes(b"".join(parts))
    return path, " ".join(texts), total / (RATE * 2)
