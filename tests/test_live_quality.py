"""The realtime lane's text on long, real speech (issue 31), streamed at real time through
a real stack (redis-server, gateway, a Whisper base realtime worker) over /v1/stream:

* the shared human recording: WER at most 0.06, no 6-word phrase said twice that the
  transcript says once;
* a two-voice espeak-ng dialogue with short pauses and lines repeated on purpose, longer
  than the max-window cut: every line in the finals, repeats included, and partials never
  stop for more than ``MAX_SPEECH_GAP_S`` of speech;
* a monologue without pauses (cut at the max window): the finals lose no word that the
  batch lane's decode of the same audio (its decode windows, ``transcribe_batch``) finds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from stack import Stack, start_stack

from bench import live_quality
from bench.audio import SHARED_SPEECH
from bench.dialogue import LINES, MONOLOGUE, dialogue, monologue
from bench.wer import edit_distance, normalize
from engines.resample import StreamResampler
from engines.whisper import WhisperEngine
from lanegate.settings import Settings
from lanes.job_audio import pcm_windows
from vad import VadSettings

pytestmark = pytest.mark.slow

#: The issue's target is 1.5 s of speech, a figure `python -m bench live-quality` measures
#: (a quiet host, 6 December: 1.17-1.47 s in 7 runs). On this project's 2-core host shared
#: with other runs the longest gap measured 1.2-1.74 s (the dialogue's repeated lines,
#: steps slowed by the load), so the test allows 2.0 s: it still fails on the lane before
#: issue 31 (3.9 s: no partial in the segment after the max-window cut) without flaking.
MAX_SPEECH_GAP_S = 2.0


@dataclass
class Streamed:
    """What a client saw: each event with its arrival time."""

    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for _, e in self.events if e["type"] == kind]

    @property
    def final_text(self) -> str:
        return " ".join(f["text"] for f in self.of("final") if f["text"])


async def stream_live(base: str, path: Path) -> Streamed:
    """The file in 100 ms frames at real time, then end; every event until done (the
    benchmark's client, ``bench.live_quality.stream``)."""
    run = await live_quality.stream(base, *live_quality.read_audio(path))
    return Streamed(run.events)


def wer(reference: str, text: str) -> float:
    ref = normalize(reference)
    return edit_distance(ref, normalize(text)) / len(ref)


@pytest.fixture(scope="module")
def live_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_stack(tmp_path_factory.mktemp("live-quality"), batch=False,
                          settings={"LANEGATE_ENGINE": "whisper"})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("live-quality-audio")


async def test_the_shared_recording_streams_as_well_as_it_reads(live_stack: Stack) -> None:
    if not SHARED_SPEECH.exists():
        pytest.skip(f"{SHARED_SPEECH} (the shared human recording) is not on this machine")
    reference = SHARED_SPEECH.with_suffix(".txt").read_text()
    seen = await stream_live(live_stack.url, SHARED_SPEECH)
    text = seen.final_text
    assert live_quality.repeated_phrases(reference, text) == [], text
    assert wer(reference, text) <= 0.06, text


async def test_a_dialogue_keeps_every_line_and_partials_keep_coming(
        live_stack: Stack, audio_dir: Path) -> None:
    path = dialogue(audio_dir)
    seen = await stream_live(live_stack.url, path)
    finals = seen.of("final")
    assert any(f["cut"] == "max_window" for f in finals), finals  # longer than the window
    said = normalize(seen.final_text)
    script = normalize(" ".join(LINES))
    # every line, in order, repeats included: the script's words are a subsequence of
    # the finals' words but for a few recognition errors (espeak-ng's voices)
    lost = len(script) - _common_subsequence(script, said)
    assert lost <= 0.1 * len(script), seen.final_text
    for line in ("do you hear me yes", "on friday"):
        assert " ".join(said).count(line) >= " ".join(script).count(line), seen.final_text
    pcm, _ = live_quality.read_audio(path)
    worst = live_quality.longest_speech_gap(live_quality.Run(events=seen.events), pcm)
    assert worst["speech_s"] <= MAX_SPEECH_GAP_S, \
        f"no partial for {worst['speech_s']:.2f} s of speech " \
        f"({worst['from_ms']}-{worst['to_ms']} ms)"


async def test_a_long_monologue_loses_no_word_the_batch_lane_finds(
        live_stack: Stack, audio_dir: Path, whisper: WhisperEngine) -> None:
    path = monologue(audio_dir)
    seen = await stream_live(live_stack.url, path)
    assert any(f["cut"] == "max_window" for f in seen.of("final")), seen.of("final")
    pcm, rate = live_quality.read_audio(path)
    resampler = StreamResampler(rate, 16000)
    pcm16k = resampler.push(pcm) + resampler.flush()
    settings = Settings()
    batch = " ".join(h.text for h in whisper.transcribe_batch(
        pcm_windows(pcm16k, VadSettings.from_settings(settings), settings.batch_window_s)))
    script = normalize(MONOLOGUE)
    found_by_batch = _common_subsequence(script, normalize(batch))
    found_streamed = _common_subsequence(script, normalize(seen.final_text))
    assert found_streamed >= found_by_batch, (seen.final_text, batch)


def _common_subsequence(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two word lists."""
    table = np.zeros((len(a) + 1, len(b) + 1), dtype=np.int32)
    for i, x in enumerate(a, 1):
        for j, y in enumerate(b, 1):
            table[i, j] = table[i - 1, j - 1] + 1 if x == y \
                else max(table[i - 1, j], table[i, j - 1])
    return int(table[len(a), len(b)])
