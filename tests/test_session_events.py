"""What a realtime session sends: partials only when they carry news (changed text, at
most every ``partial_interval_s``), finals never held back, a commit's final even
without speech, the VAD's ``speech_started``, and finals that do not depend on the
steps' timing. Real espeak-ng speech, the simulated engine (pocketsphinx for the
timing), the session driven as the step loop drives it, on a simulated clock."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import read_pcm
from phrases import TALKING, TRAFFIC, spoken

from engines.base import Engine
from engines.pocketsphinx import PocketsphinxEngine
from engines.simulated import SimulatedEngine
from lanegate.settings import Settings
from lanes.session import VAD_STEP_SAMPLES, RealtimeSession
from vad import VadSettings

RATE = 16000
FRAME = 1600  # 100 ms: what a live client sends, and one decoder chunk
SENTENCES = "the weather is nice today.\n\nthe children play outside in the park"


def engine() -> SimulatedEngine:
    return SimulatedEngine(Settings(engine="simulated", sim_step_fixed_ms=0.0,
                                    sim_prefill_frame_ms=0.0, sim_decode_seq_ms=0.0), slots=2)


def live(session: RealtimeSession, eng: Engine, pcm: bytes, *, chunk: int = FRAME,
         frame_s: float = 0.1, texts: list[str] | None = None, every: int = 1
         ) -> list[tuple[float, dict[str, Any]]]:
    """Send ``pcm`` in 100 ms frames, decode in ``chunk``-sample chunks as it comes
    (after every ``every``-th frame: a worker that falls behind), then end; every event
    with the (simulated) time it was emitted at. ``texts`` collects each decoded
    chunk's hypothesis (what a partial per chunk would have sent)."""
    out: list[tuple[float, dict[str, Any]]] = []
    now = 0.0

    def decode() -> None:
        while True:
            session.analyse(VAD_STEP_SAMPLES)
            out.extend((now, e) for e in session.settle())
            pending = min(chunk, session.candidate().pending_samples)
            if not pending:
                return
            hyp = eng.step([(session.stream, session.take(pending))])[0]
            if texts is not None and hyp.text:
                texts.append(hyp.text)
            out.extend((now, e) for e in session.after_chunk(hyp, now))

    for i, off in enumerate(range(0, len(pcm), FRAME * 2)):
        session.receive(pcm[off:off + FRAME * 2], now)
        if i % every == every - 1:
            decode()
        now += frame_s
    session.end(now)
    while not session.finished:
        decode()
    return out


def test_partials_carry_news_and_finals_are_not_held_back(speech: Callable[..., Path]) -> None:
    pcm, _ = read_pcm(speech(SENTENCES))
    eng = engine()
    every = RealtimeSession("every", RATE, eng.open_stream(), VadSettings(), 25 * RATE)
    # 20 ms chunks: five decoded chunks per 100 ms frame, as a worker that keeps up does
    throttled = RealtimeSession("throttled", RATE, eng.open_stream(), VadSettings(),
                                25 * RATE, partial_interval_s=0.5)
    hypotheses: list[str] = []
    plain = live(every, eng, pcm, chunk=320, texts=hypotheses)
    news = live(throttled, eng, pcm, chunk=320)
    finals = [e for _, e in plain if e["type"] == "final"]
    assert len(finals) >= 2
    assert [e for _, e in news if e["type"] == "final"] == finals  # the same, not delayed
    partials = [(t, e) for t, e in news if e["type"] == "partial"]
    assert partials
    for (t0, a), (t1, b) in itertools.pairwise(partials):
        if a["segment"] == b["segment"]:
            assert b["text"] != a["text"]
            assert t1 - t0 >= 0.5 - 1e-9
    changed = [e for _, e in plain if e["type"] == "partial"]
    assert len(changed) < len(hypotheses) / 2  # most chunks decode no new word
    assert len(partials) < len(changed)  # and the interval holds some changes back


def test_a_commit_ends_the_utterance_even_without_speech(speech: Callable[..., Path]) -> None:
    pcm, _ = read_pcm(speech("the weather is nice today"))
    eng = engine()
    no_endpoint = VadSettings(endpoint_silence_ms=25_030)  # what turn_detection null sends
    session = RealtimeSession("c", RATE, eng.open_stream(), no_endpoint, 25 * RATE)
    session.receive(pcm, 0.0)
    session.commit()
    session.receive(bytes(RATE), 1.0)  # one second of silence, then a commit
    session.commit()
    events = [e for _, e in live(session, eng, b"")]
    started = [e for e in events if e["type"] == "speech_started"]
    finals = [e for e in events if e["type"] == "final"]
    assert [f["cut"] for f in finals] == ["commit", "commit"]
    assert finals[0]["text"]
    assert finals[0]["end_ms"] == len(pcm) // 2 * 1000 // RATE
    assert finals[1]["words"] == []
    assert finals[1]["start_ms"] == finals[1]["end_ms"]
    assert [s["segment"] for s in started] == [0]
    assert started[0]["start_ms"] < finals[0]["end_ms"]


def test_finals_do_not_depend_on_how_the_steps_were_timed(speech: Callable[..., Path]) -> None:
    """pocketsphinx carries its cepstral mean from one utterance to the next, so where an
    utterance ends shapes the next one's words: each must end at its cut, not wherever
    the cursor happened to be when the VAD decided (it once was: TALKING after TRAFFIC
    came back at recall 0.38 or 0.75 by the timing of the steps, the same audio). Its
    words also depend on where its calls split the audio: a step's chunk must not."""
    pcm, _ = read_pcm(speech(spoken(TRAFFIC, TALKING)))
    pcm += bytes(RATE * 3)
    eng = PocketsphinxEngine(Settings(), slots=1, batch_decoder=False)
    finals = set()
    for chunk, every in ((320, 1), (1600, 1), (8000, 3), (1600, 7), (32000, 11)):
        session = RealtimeSession("t", RATE, eng.open_stream(), VadSettings(), 25 * RATE)
        events = live(session, eng, pcm, chunk=chunk, every=every)
        session.stream.close()
        finals.add(tuple((e["text"], e["start_ms"], e["end_ms"])
                         for _, e in events if e["type"] == "final"))
    assert len(finals) == 1, finals
    assert len(next(iter(finals))) == 2
