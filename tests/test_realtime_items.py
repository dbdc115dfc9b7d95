"""The Realtime API's item bookkeeping and session configuration, without a server:
which item a worker event belongs to, the deltas of stable text, the VAD mapping."""

from __future__ import annotations

import pytest

from gateway.audio_formats import AudioFormat
from gateway.realtime_config import ConfigError, TranscriptionConfig
from gateway.realtime_items import EventIds, Items
from lanegate.settings import Settings

DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"


def deltas(events: list[dict[str, object]]) -> str:
    return "".join(str(e["delta"]) for e in events if e["type"] == DELTA)


def test_deltas_send_the_words_two_partials_agree_on_short_of_the_last() -> None:
    items = Items(EventIds(), server_vad=True)
    out = items.speech_started(0, 120)
    sent = ""
    for partial in ("there", "there is", "there is at", "there is a lot", "there is a lot of",
                    "there is a lot of traffic"):
        sent += deltas(items.partial(0, partial))
    assert sent == "there is a lot"  # "at" was never sent: a later partial revised it
    out = items.final(0, "there is a lot of traffic on", start_ms=120, end_ms=2500,
                      cut="endpoint")
    assert [e["type"] for e in out] == ["input_audio_buffer.speech_stopped",
                                        "input_audio_buffer.committed", DELTA, COMPLETED]
    assert sent + deltas(out) == "there is a lot of traffic on"
    assert out[-1]["transcript"] == "there is a lot of traffic on"
    assert out[-1]["usage"] == {"type": "duration", "seconds": 2.38}


def test_vad_events_keep_audio_order_when_the_final_lags_the_vad() -> None:
    """The worker's ``speech_stopped`` comes when the VAD closes a segment; the next
    segment's ``speech_started`` may come before the first one's final (the decoder is
    behind the VAD). Started and stopped alternate, a repeat (a failover's replay) is
    dropped, and the item is committed at the stop, completed at its final."""
    items = Items(EventIds(), server_vad=True)
    out = items.speech_started(0, 100)
    out += items.speech_stopped(0, 900, "endpoint")
    out += items.speech_started(1, 1100)
    out += items.speech_started(1, 1100)  # repeated: dropped
    out += items.final(0, "one", start_ms=100, end_ms=900, cut="endpoint")
    out += items.speech_stopped(1, 2000, "endpoint")
    out += items.speech_stopped(1, 2000, "endpoint")  # repeated: dropped
    out += items.final(1, "two", start_ms=1100, end_ms=2000, cut="endpoint")
    started, stopped = "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"
    committed = "input_audio_buffer.committed"
    assert [e["type"] for e in out] == [started, stopped, committed, started, DELTA, COMPLETED,
                                        stopped, committed, DELTA, COMPLETED]
    assert [e.get("audio_start_ms", e.get("audio_end_ms")) for e in out
            if e["type"] in (started, stopped)] == [100, 900, 1100, 2000]
    first, second = out[0]["item_id"], out[3]["item_id"]
    assert [e["item_id"] for e in out if e["type"] == COMPLETED] == [first, second]
    assert items.speech_started(0, 100) == []  # a completed segment's replay: dropped


def test_a_revised_final_is_the_transcript_though_the_deltas_cannot_say_so() -> None:
    items = Items(EventIds(), server_vad=True)
    for partial in ("the rain", "the rain will", "the rain will come"):
        items.partial(0, partial)
    out = items.final(0, "it will rain", start_ms=0, end_ms=1000, cut="endpoint")
    assert not deltas(out)
    assert out[-1]["transcript"] == "it will rain"


def test_commit_mode_items_span_commits_and_a_clear_drops_its_audio() -> None:
    items = Items(EventIds(), server_vad=False)
    assert items.speech_started(0, 0) == []  # no VAD events without turn detection
    items.partial(0, "one two three")
    committed = items.commit(1.5)
    assert [e["type"] for e in committed] == ["input_audio_buffer.committed"]
    items.partial(0, "one two three four")  # still the committed item's audio
    items.clear()
    out = items.final(0, "one two three four", start_ms=0, end_ms=1500, cut="commit")
    assert out[-1]["type"] == COMPLETED
    assert out[-1]["item_id"] == committed[0]["item_id"]
    assert out[-1]["usage"]["seconds"] == 1.5
    assert items.partial(1, "dropped") == []
    assert items.final(1, "dropped", start_ms=1500, end_ms=1800, cut="commit") == []
    second = items.commit(0.5)
    assert second[0]["previous_item_id"] == committed[0]["item_id"]
    failed = items.failed("worker_lost", "gone")
    assert [(e["type"], e["item_id"]) for e in failed] == [
        ("conversation.item.input_audio_transcription.failed", second[0]["item_id"])]


def test_turn_detection_maps_onto_the_vad() -> None:
    settings = Settings()
    config = TranscriptionConfig.initial(settings)
    assert config.vad_overrides() == {"aggressiveness": settings.vad_aggressiveness,
                                      "pad_ms": settings.pad_ms,
                                      "endpoint_silence_ms": settings.endpoint_silence_ms}
    update = {"type": "session.update", "session": {"type": "transcription", "audio": {
        "input": {"format": {"type": "audio/pcmu"},
                  "turn_detection": {"type": "server_vad", "threshold": 0.8,
                                     "prefix_padding_ms": 300, "silence_duration_ms": 450}}}}}
    new = config.updated(update, settings)
    assert (new.format, new.rate) == (AudioFormat.PCMU, 8000)
    assert new.vad_overrides() == {"aggressiveness": 3, "pad_ms": 300,
                                   "endpoint_silence_ms": 450}
    off = new.updated({"type": "transcription_session.update",
                       "session": {"turn_detection": None}}, settings)
    assert off.vad_overrides() == {"endpoint_silence_ms": None}
    assert off.render(beta=True)["input_audio_format"] == "g711_ulaw"
    with pytest.raises(ConfigError, match="at least one frame"):
        config.updated({"type": "session.update", "session": {"audio": {"input": {
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 5}}}}}, settings)
