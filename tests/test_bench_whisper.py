"""Pure parts of the Whisper benchmark: WhisperLive's messages read into lag and text,
the verdicts, and the BENCHMARKS.md section kept between its markers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from bench import whisper_report
from bench.peer_load import PeerResult, PeerStream
from bench.wsclient import OP_TEXT


def segments_message(*segs: tuple[float, float, str, bool]) -> bytes:
    return json.dumps({"uid": "u", "segments": [
        {"start": f"{a:.3f}", "end": f"{b:.3f}", "text": t, "completed": c}
        for a, b, t, c in segs]}).encode()


def test_peer_stream_times_forward_moving_partials_and_joins_completed_text() -> None:
    async def scenario() -> tuple[PeerResult, str]:
        stream = PeerStream(PeerResult(), t0=0.0)
        stream.on_message(OP_TEXT, json.dumps({"message": "SERVER_READY"}).encode())
        stream.frame_end_s = [0.1 * (i + 1) for i in range(60)]
        stream.frame_sent = [100.0 + 0.1 * i for i in range(60)]
        stream.on_message(OP_TEXT, segments_message((0.0, 2.0, " hello", False)))
        stream.on_message(OP_TEXT, segments_message((0.0, 2.0, " hello", False)))  # no move
        stream.on_message(OP_TEXT, segments_message((0.0, 2.5, " hello world", True),
                                                    (2.5, 4.0, " and more", False)))
        return stream.result, stream.text()

    result, text = asyncio.run(scenario())
    assert len(result.lag_ms) == 2  # the repeat of the same end is not a new partial
    assert result.messages == 3
    assert text == "hello world and more"


def peer_doc(our_flood_p99: float, their_flood_p99: float) -> dict[str, Any]:
    def w(p99: float, wer: float = 0.05) -> dict[str, Any]:
        return {"partial_ms": {"p50": p99 / 2, "p99": p99}, "live_wer": wer}

    return {"results": {
        "peer": {"whisperlive": {"one": w(3000), "two": w(8000), "two_flood": w(their_flood_p99)},
                 "lanegate": {"one": w(900), "two": w(1000), "two_flood": w(our_flood_p99)}},
        "capacity": {"steps": [{"streams": n, "partial_ms": {"p99": 900.0},
                                "final_ms": {"p99": 1500.0}, "errors": {}}
                               for n in (1, 2, 3)]}}}


def test_peer_verdicts() -> None:
    met = whisper_report.verdicts(peer_doc(1200, 10000))
    assert met["peer_p99_share"]["verdict"] == "met"
    assert met["capacity_vs_peer"]["verdict"] == "met"  # 3 streams against 0
    missed = whisper_report.verdicts(peer_doc(3000, 10000))
    assert missed["peer_p99_share"]["verdict"] == "missed"
    assert missed["overall"]["verdict"] == "missed"


def test_peer_streams_held_counts_windows_under_the_limit() -> None:
    def side(*p99: float) -> dict[str, Any]:
        return {k: {"partial_ms": {"p99": v}} for k, v in zip(("one", "two"), p99, strict=False)}

    assert whisper_report.peer_streams_held(side(3000, 8000)) == 0
    assert whisper_report.peer_streams_held(side(1000, 8000)) == 1
    assert whisper_report.peer_streams_held(side(1000, 1400)) == 2


def test_section_replaces_only_what_is_between_its_markers(tmp_path: Path) -> None:
    doc = {"command": "python -m bench whisper", "results": {},
           "options": {"rt_cpus": "0", "batch_cpus": "1"},
           "machine": {"date_utc": "now", "git_commit": "abcdef1234"}}
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nthe rest\n")
    whisper_report.write_section(doc, md)
    whisper_report.write_section(doc, md)
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nthe rest\n")
    assert text.count(whisper_report.BEGIN) == 1
    assert text.count(whisper_report.END) == 1


def test_a_capacity_step_holds_only_with_partials_and_finals_in_time() -> None:
    from bench.whisper_bench import held

    def step(p99: float | None, f99: float | None, errors: dict[str, int] | None = None
             ) -> dict[str, Any]:
        return {"partial_ms": {"p99": p99}, "final_ms": {"p99": f99}, "errors": errors or {}}

    assert held(step(900, 1500))
    assert not held(step(1600, 1500))
    assert not held(step(700, 4000))  # few quick partials, finals late
    assert not held(step(None, 1500))
    assert not held(step(900, 1500, {"no_free_slot": 1}))
