"""Deepgram's ``/v1/listen`` query and key forms (``gateway/deepgram_params.py``), on
requests as aiohttp builds them; the same rules end to end: ``tests/test_deepgram.py``."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from gateway.deepgram_params import DeepgramParams, ParamError, parse_params, presented_key
from lanegate.settings import Settings

SETTINGS = Settings()


def params(query: str, *, live: bool = True) -> DeepgramParams:
    return parse_params(make_mocked_request("GET", "/v1/listen?" + query), SETTINGS, live=live)


def refusal(query: str, *, live: bool = True) -> ParamError:
    with pytest.raises(ParamError) as refused:
        params(query, live=live)
    return refused.value


RAW = "encoding=linear16&sample_rate=16000"


def test_what_pipecat_and_livekit_send_is_taken() -> None:
    got = params(RAW + "&model=nova-3-general&language=en&interim_results=true&punctuate=true"
                 "&smart_format=false&diarize=false&dictation=false&numerals=false"
                 "&profanity_filter=false&filler_words=true&no_delay=true&vad_events=true"
                 "&endpointing=25&channels=1&mip_opt_out=false")
    assert (got.encoding, got.sample_rate, got.language) == ("linear16", 16000, "en")
    assert got.interim_results
    assert got.vad_events
    # LiveKit's 25 ms is raised to what the VAD can end a segment on
    assert got.vad == {"endpoint_silence_ms": SETTINGS.deepgram_min_endpointing_ms}


def test_endpointing_forms() -> None:
    assert params(RAW).vad == {}  # the worker's endpoint_silence_ms
    assert params(RAW + "&endpointing=800").vad == {"endpoint_silence_ms": 800}
    assert params(RAW + "&endpointing=false").vad == {"endpoint_silence_ms": None}
    assert "endpointing" in refusal(RAW + "&endpointing=soon").message


def test_keyterms_and_keywords_make_the_prompt() -> None:
    got = params(RAW + "&keyterm=lanegate&keyterm=customer%20service&keywords=Pipecat:2"
                 "&keywords=ratio:x&keyterm=lanegate")
    assert got.prompt == "lanegate, customer service, Pipecat, ratio:x"


@pytest.mark.parametrize(("query", "language", "multi"), [
    ("", "", False), ("&language=multi", "", True), ("&language=en-US", "en-us", False)])
def test_language(query: str, language: str, multi: bool) -> None:
    got = params(RAW + query)
    assert (got.language, got.multi) == (language, multi)


@pytest.mark.parametrize(("query", "param"), [
    ("encoding=opus&sample_rate=16000", "encoding"),
    ("sample_rate=16000", "encoding"),  # live audio is raw: its encoding must be given
    ("encoding=mulaw", "sample_rate"),
    ("encoding=linear16&sample_rate=4000", "sample_rate"),
    (RAW + "&channels=0", "channels"),
    (RAW + "&channels=9", "channels"),  # over max_stream_channels (8)
    (RAW + "&diarize=true", "diarize"),
    (RAW + "&diarize_model=latest", "diarize_model"),
    (RAW + "&redact=pci", "redact"),
    (RAW + "&utterance_end_ms=500", "utterance_end_ms"),
    (RAW + "&interim_results=maybe", "interim_results"),
    (RAW + "&callback=https://example.com/hook", "callback"),  # prerecorded only
])
def test_refused_live(query: str, param: str) -> None:
    assert refusal(query).param == param


def test_prerecorded() -> None:
    got = params("callback=https://example.com/hook&punctuate=true", live=False)
    assert (got.encoding, got.callback) == (None, "https://example.com/hook")
    assert refusal("multichannel=true&channels=2", live=False).param == "multichannel"
    assert refusal("callback=https://example.com/h&callback_method=put",
                   live=False).param == "callback_method"


@pytest.mark.parametrize(("headers", "key"), [
    ({"Authorization": "Token k1"}, "k1"),
    ({"Authorization": "Bearer k2"}, "k2"),
    ({"Sec-WebSocket-Protocol": "token, k3"}, "k3"),
    ({"Sec-WebSocket-Protocol": "chat, k4"}, None),
    ({"Authorization": "Basic xyz"}, None),
    ({}, None),
])
def test_presented_key(headers: dict[str, str], key: str | None) -> None:
    request = make_mocked_request("GET", "/v1/listen", headers=CIMultiDict(headers))
    assert presented_key(request) == key
