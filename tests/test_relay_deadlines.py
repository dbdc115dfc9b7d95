"""When a relay that parks (the OpenAI Realtime API's, Deepgram's) is closed if nothing
more comes: ``gateway.relay.parked_deadline``, without a server."""

from __future__ import annotations

import pytest

from gateway.relay import Timeline, parked_deadline
from lanegate.settings import Settings

RATE = 16000
SETTINGS = Settings(idle_timeout_s=30.0, min_realtime_ratio=0.5,
                    realtime_idle_timeout_s=600.0, realtime_max_session_s=1800.0)


def timeline(audio_s: float, last_arrival: float) -> Timeline:
    t = Timeline(RATE)
    t.add(int(audio_s * RATE) * 2, last_arrival)
    return t


def test_a_parked_session_is_closed_after_the_realtime_idle_timeout_not_idle_timeout_s() -> None:
    audio = timeline(5.0, last_arrival=105.0)  # 5 s of speech, then silence
    at, failure = parked_deadline(SETTINGS, started=100.0, last_activity=105.0,
                                  attached=None, timeline=audio)
    assert at == pytest.approx(705.0)
    assert failure.code == "timeout"
    assert "realtime_idle_timeout_s" in failure.message


def test_a_client_event_moves_the_idle_close_and_the_maximum_stays() -> None:
    audio = timeline(5.0, last_arrival=105.0)
    at, failure = parked_deadline(SETTINGS, started=100.0, last_activity=1500.0,
                                  attached=None, timeline=audio)
    assert at == pytest.approx(1900.0)  # opened at 100, open at most 1800 s
    assert "realtime_max_session_s" in failure.message


def test_the_trickle_rule_counts_from_when_the_session_took_its_slot() -> None:
    # 5 s of audio before a 10-minute park: resumed at 700 s, it is not charged for
    # the silence it parked through
    audio = timeline(5.0, last_arrival=700.0)
    at, _ = parked_deadline(SETTINGS, started=100.0, last_activity=700.0,
                            attached=(700.0, 5000.0), timeline=audio)
    assert at == pytest.approx(730.0)  # no audio since: idle_timeout_s of slack
    # a trickle after the resume still ends: 1 s of audio in the first 60 s
    trickle = timeline(6.0, last_arrival=759.0)
    at, failure = parked_deadline(SETTINGS, started=100.0, last_activity=759.0,
                                  attached=(700.0, 5000.0), timeline=trickle)
    assert at == pytest.approx(700.0 + 1.0 / 0.5 + 30.0)
    assert "min_realtime_ratio" in failure.message
