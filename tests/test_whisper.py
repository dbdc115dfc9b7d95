"""The Whisper engine with the real bundled base model (loaded once per test session):
streaming partials and finals, language detection, silence and noise, batched
decoding, and the model's digest check."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import read_pcm, synthesize
from phrases import FRIENDLY, SENTENCE_RECALL, TRAFFIC, recall

from bench.audio import SHARED_SPEECH
from bench.live_quality import repeated_phrases
from engines import DecodeOptions, NoFreeSlot, models
from engines.base import Task
from engines.whisper import Decoded, WhisperEngine, WhisperStream, drop_repeats
from lanegate.settings import Settings
from lanegate.transcript import Word
from vad import segment_pcm

REPO = Path(__file__).resolve().parent.parent
SPANISH = "mañana vamos a la playa con nuestros amigos"
CHUNK = 6400  # 200 ms


def chunks(pcm: bytes, size: int = CHUNK) -> list[bytes]:
    return [pcm[i : i + size] for i in range(0, len(pcm), size)]


def test_a_streamed_sentence_gets_growing_partials_and_a_timed_final(
        whisper: WhisperEngine, speech: Callable[..., Path]) -> None:
    pcm, _ = read_pcm(speech(TRAFFIC))
    pcm += bytes(16000)  # the trailing silence an endpoint would include
    stream = whisper.open_stream(DecodeOptions(language="en"))
    partials = [whisper.step([(stream, c)])[0].text for c in chunks(pcm, 12800)]
    final = stream.finish()
    stream.close()
    shown = [p for p in partials if p]
    assert shown, "partials appear while the audio arrives"
    for before, after in itertools.pairwise(shown):
        assert after.startswith(before), f"partial text never takes a word back: {shown}"
    assert recall(TRAFFIC, final.text) >= 0.9, final.text
    assert final.text.startswith(shown[-1])
    assert final.language == "en"
    assert [w.word for w in final.words] == final.text.split()
    duration = len(pcm) / 32000
    for a, b in zip(final.words, final.words[1:], strict=False):
        assert 0 <= a.start <= a.end <= b.start + 1e-6
    assert final.words[-1].end <= duration


def test_one_step_decodes_several_sessions_in_one_call(
        whisper: WhisperEngine, speech: Callable[..., Path]) -> None:
    one, _ = read_pcm(speech(TRAFFIC))
    two, _ = read_pcm(speech(FRIENDLY))
    a, b = whisper.open_stream(), whisper.open_stream()
    whisper.step([(a, one + bytes(16000)), (b, two + bytes(16000))])
    profile = whisper.last_profile()
    fa, fb = a.finish(), b.finish()
    a.close()
    b.close()
    assert profile is not None
    assert profile.seqs == 2
    assert recall(TRAFFIC, fa.text) >= 0.9, fa
    assert recall(FRIENDLY, fb.text) >= 0.9, fb


def test_spanish_is_detected_without_a_language(
        whisper: WhisperEngine, tmp_path: Path) -> None:
    pcm, _ = read_pcm(synthesize(SPANISH, tmp_path / "es.wav", voice="es"))
    batch = whisper.transcribe_batch([pcm])[0]
    assert batch.language == "es"
    assert recall(SPANISH, batch.text.lower()) >= 0.6, batch.text
    stream = whisper.open_stream()
    for c in chunks(pcm + bytes(16000), 16000):
        whisper.step([(stream, c)])
    final = stream.finish()
    stream.close()
    assert final.language == "es", final


#: Whisper base translates this espeak-ng Spanish into "... I like the coffee very much."
COFFEE = "Buenos días. Me gusta mucho el café."


def test_the_translate_task_gives_english_in_both_lanes(
        whisper: WhisperEngine, tmp_path: Path) -> None:
    pcm, _ = read_pcm(synthesize(COFFEE, tmp_path / "es.wav", voice="es"))
    spanish = whisper.transcribe_batch([pcm])[0]
    batch = whisper.transcribe_batch([pcm], DecodeOptions(task=Task.TRANSLATE))[0]
    stream = whisper.open_stream(DecodeOptions(task=Task.TRANSLATE))
    for c in chunks(pcm + bytes(16000), 16000):
        whisper.step([(stream, c)])
    final = stream.finish()
    stream.close()
    assert {"gusta", "mucho"} <= set(spanish.text.lower().replace(",", "").split()), spanish
    for hyp in (batch, final):
        words = set(hyp.text.lower().replace(",", "").replace(".", "").split())
        assert {"like", "coffee"} <= words, hyp
        assert hyp.language == "es", hyp  # the speech's language, detected
        assert [w.word for w in hyp.words] == hyp.text.split()


def test_a_given_language_is_used(whisper: WhisperEngine, tmp_path: Path) -> None:
    pcm, _ = read_pcm(synthesize(SPANISH, tmp_path / "es.wav", voice="es"))
    hyp = whisper.transcribe_batch([pcm], DecodeOptions(language="en"))[0]
    assert hyp.language == "en"
    with pytest.raises(ValueError, match="klingon"):
        whisper.open_stream(DecodeOptions(language="klingon"))


def test_silence_and_brown_noise_give_no_text(whisper: WhisperEngine, tmp_path: Path) -> None:
    noise = tmp_path / "noise.wav"
    subprocess.run(["sox", "-R", "-n", "-r", "16000", "-c", "1", "-b", "16", str(noise),
                    "synth", "60", "brownnoise"], check=True)
    pcm, _ = read_pcm(noise)
    segments = [pcm[s.start * 2 : s.end * 2] for s in segment_pcm(pcm)]
    assert segments, "webrtcvad takes brown noise for speech: Whisper must reject it"
    assert [h.text for h in whisper.transcribe_batch(segments)] == [""] * len(segments)
    stream = whisper.open_stream()
    texts = [whisper.step([(stream, c)])[0].text for c in chunks(bytes(64000), 16000)]
    assert stream.finish().text == ""
    assert texts == [""] * len(texts)
    stream.close()


def test_batch_keeps_order_and_word_timings(
        whisper: WhisperEngine, speech: Callable[..., Path]) -> None:
    one, _ = read_pcm(speech(TRAFFIC))
    two, _ = read_pcm(speech(FRIENDLY))
    hyps = whisper.transcribe_batch([two + one, one, bytes(32000)])
    assert recall(TRAFFIC + " " + FRIENDLY, hyps[0].text) >= 0.9, hyps[0].text
    assert recall(TRAFFIC, hyps[1].text) >= SENTENCE_RECALL
    assert hyps[2].text == ""
    assert hyps[0].words[-1].end > len(two) / 32000  # the second sentence is timed after it


def test_the_slots_are_a_fixed_pool(whisper: WhisperEngine) -> None:
    free = whisper.slots_free()
    streams = [whisper.open_stream() for _ in range(free)]
    with pytest.raises(NoFreeSlot, match="slots are in use"):
        whisper.open_stream()
    for s in streams:
        s.close()
    assert whisper.slots_free() == free


# --- the bundled model -------------------------------------------------------------

def test_the_model_is_assembled_verified_and_reused(whisper_data: Path) -> None:
    path = models.resolve("base", str(whisper_data))
    assert models.sha256_of(path / "model.bin") == models.BUNDLED["base"].sha256
    assert {p.name for p in path.iterdir()} == {"model.bin", *models.SIDE_FILES}
    assert models.resolve("base", str(whisper_data)) == path


def test_a_corrupted_model_is_refused_at_start(tmp_path: Path) -> None:
    path = models.resolve("base", str(tmp_path))
    with open(path / "model.bin", "r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01\x02")
    with pytest.raises(models.ModelError, match="sha256"):
        WhisperEngine(Settings(data_dir=str(tmp_path)), slots=1)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "lanegate.cli", "worker", "--lane", "realtime",
         "--engine", "whisper", "--data-dir", str(tmp_path),
         "--redis-url", "redis://127.0.0.1:1/0"],
        capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "sha256" in done.stderr
    assert "corrupt" in done.stderr
    listed = lanegate_models(tmp_path)
    assert listed.returncode == 1
    assert listed.stdout.startswith("base\tBAD")


def lanegate_models(data: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lanegate.cli", "models", "--data-dir", str(data)],
                          capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_lanegate_models_lists_verifies_and_locates(whisper_data: Path) -> None:
    listed = lanegate_models(whisper_data)
    assert listed.returncode == 0, listed.stderr
    name, state, digest, path = listed.stdout.splitlines()[0].split("\t")
    assert (name, state, digest) == ("base", "ok", "sha256 " + models.BUNDLED["base"].sha256)
    assert Path(path) == models.cache_dir(models.BUNDLED["base"], str(whisper_data))


def test_a_model_path_without_a_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(models.ModelError, match="neither a bundled model"):
        models.resolve(str(tmp_path), str(tmp_path))


def test_a_prompt_steers_but_is_not_transcribed(
        whisper: WhisperEngine, speech: Callable[..., Path]) -> None:
    pcm, _ = read_pcm(speech(TRAFFIC))
    prompt = "Morning traffic report from the motorway control room."
    hyp = whisper.transcribe_batch([pcm], DecodeOptions(language="en", prompt=prompt))[0]
    assert recall(TRAFFIC, hyp.text) >= 0.9, hyp.text
    assert "control room" not in hyp.text.lower()


def test_a_repeat_with_no_audio_left_for_it_is_dropped_and_a_real_one_kept() -> None:
    eot, ts = 50257, 50364  # <|endoftext|>, <|0.00|>; timestamps are 20 ms apart
    at = {s: ts + int(s / 0.02) for s in (2.0, 2.6, 4.6, 5.0)}
    vocab = {1: "We", 2: "have", 3: "work.", 11: "we", 12: "ha"}

    def words_of(tokens: list[int]) -> list[str]:
        return [vocab[t] for t in tokens]

    # 2.64 s of audio: the sentence again at 2.0 s (cut short, other case) has no room
    assert drop_repeats([ts, 1, 2, 3, at[2.0], at[2.0], 11, 12, eot], eot, ts, 2.64,
                        words_of) == [1, 2, 3]
    # 5.3 s of audio: said twice, the second time with room for it
    assert drop_repeats([ts, 1, 2, 3, at[2.6], at[2.6], 1, 2, 3, at[5.0]], eot, ts, 5.3,
                        words_of) == [1, 2, 3, 1, 2, 3]
    assert drop_repeats([ts, 1, 2, at[2.0], at[2.0], 3, at[4.6]], eot, ts, 2.5,
                        words_of) == [1, 2, 3]
    assert drop_repeats([1, 2, 3], eot, ts, 1.0, words_of) == [1, 2, 3]


def test_a_doubtful_final_decode_keeps_the_words_two_decodes_agreed_on(
        whisper: WhisperEngine) -> None:
    """The final decode is fresh (no committed prefix); if the model doubts it (no-speech,
    a low log-probability), the final says the words the partials already showed, not
    nothing. Noise has no agreed words, so it still gives no text."""
    stream = whisper.open_stream()
    assert isinstance(stream, WhisperStream)
    try:
        # 1.8 s: two words behind the horizon, none old enough to be committed unagreed
        stream.append(bytes(int(1.8 * 16000) * 2))
        stream.gate.voiced_end = len(stream.audio) // 2  # as if voiced to the end
        words = [Word("Hello", 0.2, 0.5), Word("big", 0.6, 0.8), Word("world.", 0.9, 1.3)]
        heard = Decoded([1, 2, 3], words, [[1], [2], [3]], "en", no_speech=False)
        stream.take(heard)
        stream.take(heard)  # two decodes agree: all but the last word are committed
        assert stream.partial.text == "Hello big"
        stream.last_chunk()
        stream.take(Decoded([], [], [], "en", no_speech=True))
        assert stream.hyp.text == "Hello big"
        assert stream.partial.text == ""  # no partial after the final's decode
        assert stream.finish().text == "Hello big"
        stream.append(bytes(3 * 16000 * 2))  # the next segment: nothing agreed on
        stream.last_chunk()
        stream.take(Decoded([], [], [], "en", no_speech=True))
        assert stream.finish().text == ""
    finally:
        stream.close()


@pytest.mark.skipif(not SHARED_SPEECH.exists(), reason="the shared human recording is not here")
def test_a_batch_segment_says_its_last_sentence_once(whisper: WhisperEngine) -> None:
    """The batch lane's first segment of the shared recording (0-13.04 s, as the VAD cut
    it in a `lanegate transcribe`), converted by sox without dither: decoded alone,
    Whisper said its last sentence again into the trailing silence, the repeat's words
    all placed past the voice (with sox's dither it happens not to)."""
    undithered = subprocess.run(
        ["sox", str(SHARED_SPEECH), "-t", "raw", "-r", "16000", "-c", "1", "-b", "16",
         "-e", "signed-integer", "-D", "-"], check=True, capture_output=True).stdout
    pcm = undithered[: round(13.04 * 16000) * 2]
    (hyp,) = whisper.transcribe_batch([pcm])
    reference = " ".join(SHARED_SPEECH.with_suffix(".txt").read_text().split()[:36])
    assert "epoch of incredulity" in hyp.text
    assert repeated_phrases(reference, hyp.text) == [], hyp.text
    assert hyp.words[-1].word.lower().startswith("incredulity"), hyp.text


@pytest.mark.skipif(not SHARED_SPEECH.exists(), reason="the shared human recording is not here")
def test_a_piece_is_decoded_for_good_in_a_step_of_its_own(whisper: WhisperEngine) -> None:
    """The shared recording's first 13 s segment, streamed in 400 ms steps: once the
    committed words reach most of a step window, the stream says its next decode is for
    good (the planner then keeps it out of other sessions' partial steps), and that step
    decodes the finished piece alone: one sequence, no fresher partial. The steps after it
    decode the window again, and the final has every sentence once."""
    undithered = subprocess.run(
        ["sox", str(SHARED_SPEECH), "-t", "raw", "-r", "16000", "-c", "1", "-b", "16",
         "-e", "signed-integer", "-D", "-"], check=True, capture_output=True).stdout
    pcm = undithered[: round(13.04 * 16000) * 2]
    stream = whisper.open_stream(DecodeOptions(language="en"))
    assert isinstance(stream, WhisperStream)
    try:
        steps = chunks(pcm, 12800)
        sealed_at = None
        partial = ""
        for k, chunk in enumerate(steps[:-1]):
            for_good = stream.decodes_for_good()
            hyp = whisper.step([(stream, chunk)])[0]
            if for_good:
                sealed_at = k
                profile = whisper.last_profile()
                assert profile is not None
                assert profile.seqs == 1, "the piece alone"
                assert hyp.text == partial, "a piece step brings no partial"
                assert stream.sealed, "the piece's words are final text"
                break
            partial = hyp.text
        assert sealed_at is not None, "a 13 s segment is sealed in pieces (10 s window)"
        # The steps after it decode the window again: the text grows past the piece within
        # 1.2 s of audio. Not necessarily in the very next step: where the piece is sealed
        # moves with the CPU's int8 kernels (9.2 s on a Xeon, where 9.2-9.6 s holds only
        # the pause before "It was the epoch of belief"), and a step that hears no word
        # yet has nothing to add.
        grown = None
        for k in range(sealed_at + 1, min(sealed_at + 4, len(steps) - 1)):
            if len(whisper.step([(stream, steps[k])])[0].text) > len(partial):
                grown = k
                break
        assert grown is not None, "the steps after the piece decode the window again"
        stream.last_chunk()
        assert stream.decodes_for_good(last=True)
        whisper.step([(stream, b"".join(steps[grown + 1 :]))])
        final = stream.finish()
    finally:
        stream.close()
    reference = " ".join(SHARED_SPEECH.with_suffix(".txt").read_text().split()[:36])
    assert repeated_phrases(reference, final.text) == [], final.text
    assert final.text.rstrip(".").endswith("epoch of incredulity"), final.text
