"""Engines: the real pocketsphinx decoder on espeak-ng speech, the simulated cost model,
and the streaming resampler."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import read_pcm
from phrases import SENTENCE_RECALL, TALKING, TRAFFIC, recall, words

from engines import Hypothesis, NoFreeSlot, create_engine
from engines.pocketsphinx import PocketsphinxEngine
from engines.resample import StreamResampler
from engines.simulated import SimulatedEngine
from lanegate.settings import Settings, SettingsError

SENTENCE = TRAFFIC
OTHER = TALKING


@pytest.fixture(scope="module")
def ps() -> PocketsphinxEngine:
    return PocketsphinxEngine(Settings(), slots=2)


def chunks(pcm: bytes, size: int) -> list[bytes]:
    return [pcm[i : i + size] for i in range(0, len(pcm), size)]


def test_pocketsphinx_streams_partials_and_timed_final(
    ps: PocketsphinxEngine, speech: Callable[..., Path]
) -> None:
    pcm, rate = read_pcm(speech(SENTENCE))
    assert rate == 16000
    stream = ps.open_stream()
    partials = [ps.step([(stream, c)])[0].text for c in chunks(pcm, 3200)]
    final = stream.finish()
    stream.close()
    assert any(partials[: len(partials) * 3 // 4]), "partials appear while audio arrives"
    assert recall(SENTENCE, final.text) >= SENTENCE_RECALL, final.text
    assert [w.word for w in final.words] == final.text.split()
    duration = len(pcm) / 2 / rate
    for a, b in zip(final.words, final.words[1:], strict=False):
        assert 0 <= a.start < a.end <= b.start + 1e-6
    assert final.words[-1].end <= duration + 0.05


def test_pocketsphinx_slots_are_a_fixed_pool(ps: PocketsphinxEngine) -> None:
    assert ps.slots_free() == 2
    a, b = ps.open_stream(), ps.open_stream()
    assert ps.slots_free() == 0
    with pytest.raises(NoFreeSlot):
        ps.open_stream()
    a.close()
    assert ps.slots_free() == 1
    c = ps.open_stream()
    b.close()
    c.close()
    assert ps.slots_free() == 2


def test_pocketsphinx_batch_matches_streams_own_text(
    ps: PocketsphinxEngine, speech: Callable[..., Path]
) -> None:
    one, _ = read_pcm(speech(OTHER))
    two, _ = read_pcm(speech(SENTENCE))
    hyps = ps.transcribe_batch([one, two])
    assert len(hyps) == 2
    assert recall(OTHER, hyps[0].text) >= SENTENCE_RECALL, hyps[0].text
    assert recall(SENTENCE, hyps[1].text) >= SENTENCE_RECALL, hyps[1].text
    assert recall(SENTENCE, hyps[1].text) > recall(SENTENCE, hyps[0].text)
    pieces = list(ps.transcribe_segment_pieces(two))
    assert pieces[:-1] == [None] * (len(pieces) - 1)
    assert len(pieces) - 1 == -(-len(two) // 32000)  # one yield per second of audio
    # every segment starts the features afresh: the same audio, the same words
    assert pieces[-1] == hyps[1]


def test_pocketsphinx_slot_text_does_not_depend_on_earlier_sessions(
    speech: Callable[..., Path]
) -> None:
    ps = PocketsphinxEngine(Settings(), slots=1, batch_decoder=False)  # a fresh decoder

    def decode(pcm: bytes) -> Hypothesis:
        stream = ps.open_stream()
        for c in chunks(pcm, 3200):
            ps.step([(stream, c)])
        final = stream.finish()
        stream.close()
        return final

    # a clip whose words shifted with the slot's history while sessions only reset the
    # cepstral mean (set_cmn): on a fresh decoder and on the same one again, two texts
    touchy, _ = read_pcm(speech("can you send me the report before friday"))
    other, _ = read_pcm(speech(OTHER))
    first = decode(touchy)
    assert decode(touchy) == first
    assert decode(other).text != first.text
    assert decode(touchy) == first


def test_pocketsphinx_rejects_odd_bytes(ps: PocketsphinxEngine) -> None:
    stream = ps.open_stream()
    try:
        with pytest.raises(ValueError, match="even"):
            ps.step([(stream, b"\x00\x01\x02")])
    finally:
        stream.close()


def test_pocketsphinx_finishes_an_utterance_too_short_to_search(
        ps: PocketsphinxEngine) -> None:
    """A client may commit 50 ms (the Realtime API's clear does): no words, no crash."""
    stream = ps.open_stream()
    try:
        stream.start()
        ps.step([(stream, bytes(1600))])  # 50 ms of silence
        assert stream.finish().words == ()
    finally:
        stream.close()


def test_resampled_telephony_is_recognized(
    ps: PocketsphinxEngine, speech: Callable[..., Path]
) -> None:
    # 8 kHz telephony lacks the 4-8 kHz band the wideband model was trained on:
    # it comes through the resampler as speech, but is recognized poorly.
    for rate, least in ((8000, 0.0), (44100, SENTENCE_RECALL), (48000, SENTENCE_RECALL)):
        got_words = ""
        for text in (SENTENCE, OTHER):
            pcm, got = read_pcm(speech(text, rate=rate))
            assert got == rate
            resampler = StreamResampler(rate)
            pcm16 = b"".join(resampler.push(c) for c in chunks(pcm, 1001)) + resampler.flush()
            assert abs(len(pcm16) / 2 / 16000 - len(pcm) / 2 / rate) < 0.01
            got_words += " " + ps.transcribe_batch([pcm16])[0].text
        assert got_words.split(), rate
        assert recall(SENTENCE + " " + OTHER, got_words) >= least, (rate, got_words)


def test_resampler_keeps_a_tone_and_its_length() -> None:
    t = np.arange(48000) / 48000
    tone = (8000 * np.sin(2 * np.pi * 1000 * t)).astype(np.int16).tobytes()
    resampler = StreamResampler(48000)
    out = b"".join(resampler.push(c) for c in chunks(tone, 999)) + resampler.flush()
    samples = np.frombuffer(out, dtype=np.int16).astype(np.float64)
    assert len(samples) == 16000
    spectrum = np.abs(np.fft.rfft(samples[1000:-1000]))
    peak_hz = np.argmax(spectrum) * 16000 / (len(samples) - 2000)
    assert abs(peak_hz - 1000) < 5
    assert 4000 < np.sqrt(np.mean(samples[1000:-1000] ** 2)) < 6500


def test_resampler_passes_16k_through_and_carries_odd_bytes() -> None:
    resampler = StreamResampler(16000)
    assert resampler.push(b"\x01\x02\x03") == b"\x01\x02"
    assert resampler.push(b"\x04") == b"\x03\x04"


def sim_settings(**changes: object) -> Settings:
    return Settings(engine="simulated").replace(**changes)


def test_simulated_text_is_deterministic_and_audio_specific(
    speech: Callable[..., Path]
) -> None:
    engine = create_engine(sim_settings(), slots=3)
    assert isinstance(engine, SimulatedEngine)
    one, _ = read_pcm(speech(SENTENCE))
    two, _ = read_pcm(speech(OTHER))
    streams = [engine.open_stream() for _ in range(3)]
    for offset in range(0, max(len(one), len(two)), 3200):
        engine.step([(streams[0], one[offset : offset + 3200]),
                     (streams[1], one[offset : offset + 7000][:3200]),
                     (streams[2], two[offset : offset + 3200])])
    finals = [s.finish() for s in streams]
    assert finals[0].text
    assert finals[0] == finals[1]
    assert not words(finals[0].text) & words(finals[2].text)
    batch = engine.transcribe_batch([one, two])
    assert [h.text for h in batch] == [finals[0].text, finals[2].text]
    silence = engine.transcribe_batch([bytes(32000)])[0]
    assert silence.text == ""


def test_simulated_cost_model_and_slots() -> None:
    engine = SimulatedEngine(
        sim_settings(sim_step_fixed_ms=2.0, sim_prefill_frame_ms=0.5, sim_decode_seq_ms=1.0),
        slots=1)
    assert engine.step_cost_s(16000, 2) == pytest.approx(0.002 + 100 * 0.0005 + 0.002)
    assert engine.cost_prior().s_per_audio_s == pytest.approx(0.05)
    prior = engine.cost_prior()
    assert (prior.step_fixed_s, prior.per_seq_s) == pytest.approx((0.002, 0.001))
    stream = engine.open_stream()
    with pytest.raises(NoFreeSlot):
        engine.open_stream()
    stream.close()
    assert engine.slots_free() == 1


def test_unknown_engine_is_a_settings_error() -> None:
    with pytest.raises(SettingsError, match="LANEGATE_ENGINE='nope'"):
        create_engine(Settings(engine="nope"), slots=1)
