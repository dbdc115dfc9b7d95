"""What a realtime session sends: partials only when they carry news (changed text, at
most every ``partial_interval_s``), finals never held back, a commit's final even
without speech, and the VAD's ``speech_started``. Real espeak-ng speech, the simulated
engine, the session driven as the step loop drives it, on a simulated clock."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import read_pcm

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


def live(session: RealtimeSession, eng: SimulatedEngine, pcm: bytes, *, chunk: int = FRAME,
         frame_s: float = 0.1, texts: list[str] | None = None
         ) -> list[tuple[float, dict[str, Any]]]:
    """Send ``pcm`` in 100 ms frames, decode in ``chunk``-sample chunks as it comes, then
    end; every event with the (simulated) time it was emitted at. ``texts`` collects
    each decoded chunk's hypothesis (what a partial per chunk would have sent)."""
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

    for off in range(0, len(pcm), FRAME * 2):
        session.receive(pcm[off:off + FRAME * 2], now)
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
