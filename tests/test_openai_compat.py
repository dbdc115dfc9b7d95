"""``POST /v1/audio/transcriptions`` through the official ``openai`` SDK, on a real stack.

The module's stack answers audio up to 8 s on the realtime lane; longer audio
goes through a batch job that the request waits for (timeout 4 s + 0.5 x audio).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from audio_files import encode
from openai import OpenAI
from phrases import MOST, SHORT, THREE
from phrases import recall as overlap
from stack import Stack, start_stack

KEY = "openai-compat-key"
LONG = THREE  # about 10.5 s
SYNC_MAX_S = 8.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_stack(tmp_path_factory.mktemp("openai-stack"), settings={
        "LANEGATE_API_KEYS": KEY,
        "LANEGATE_SYNC_MAX_SECONDS": str(SYNC_MAX_S),
        "LANEGATE_WAIT_BASE_S": "4",
        "LANEGATE_WAIT_PER_AUDIO_S": "0.5",
    })
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{stack.url}/v1", api_key=KEY) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def short_wav(speech: Callable[..., Path]) -> Path:
    return speech(SHORT)


@pytest.fixture(scope="module")
def long_wav(speech: Callable[..., Path]) -> Path:
    return speech(LONG)


@pytest.fixture(scope="module")
def short_bytes(short_wav: Path) -> bytes:
    return short_wav.read_bytes()


def list_jobs(stack: Stack) -> list[dict[str, object]]:
    import urllib.request

    request = urllib.request.Request(f"{stack.url}/v1/transcriptions?limit=100",
                                     headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        data: list[dict[str, object]] = json.load(resp)["data"]
    return data


def test_json(client: OpenAI, short_wav: Path) -> None:
    with short_wav.open("rb") as f:
        result = client.audio.transcriptions.create(model="whisper-1", file=f)
    assert overlap(SHORT, result.text) >= MOST, result.text


def test_text(client: OpenAI, short_wav: Path) -> None:
    text = client.audio.transcriptions.create(model="lanegate", file=short_wav,
                                              response_format="text")
    assert isinstance(text, str)
    assert text.endswith("\n")
    assert overlap(SHORT, text) >= MOST


def test_srt(client: OpenAI, short_wav: Path) -> None:
    srt = client.audio.transcriptions.create(model="lanegate", file=short_wav,
                                             response_format="srt")
    assert isinstance(srt, str)
    assert re.match(r"1\n\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}\n", srt), srt
    assert overlap(SHORT, srt) >= MOST


def test_vtt(client: OpenAI, short_wav: Path) -> None:
    vtt = client.audio.transcriptions.create(model="lanegate", file=short_wav,
                                             response_format="vtt")
    assert isinstance(vtt, str)
    assert vtt.startswith("WEBVTT\n\n")
    assert re.search(r"\d\d:\d\d:\d\d\.\d{3} --> \d\d:\d\d:\d\d\.\d{3}", vtt)
    assert overlap(SHORT, vtt) >= MOST


def test_verbose_json_with_segments(client: OpenAI, short_wav: Path) -> None:
    result = client.audio.transcriptions.create(
        model="lanegate", file=short_wav, response_format="verbose_json", language="en")
    assert result.language == "english"
    assert result.duration == pytest.approx(6.5, abs=3)
    assert overlap(SHORT, result.text) >= MOST
    assert result.segments
    assert [s.id for s in result.segments] == list(range(len(result.segments)))
    assert all(0 <= s.start <= s.end <= result.duration + 0.01 for s in result.segments)
    assert " ".join(s.text for s in result.segments) == result.text
    assert result.words is None


def test_verbose_json_with_word_timestamps(client: OpenAI, short_wav: Path) -> None:
    result = client.audio.transcriptions.create(
        model="lanegate", file=short_wav, response_format="verbose_json",
        timestamp_granularities=["word"])
    assert result.words
    assert result.segments is None
    starts = [w.start for w in result.words]
    assert starts == sorted(starts)
    assert all(w.start <= w.end for w in result.words)
    assert " ".join(w.word for w in result.words) == result.text
    both = client.audio.transcriptions.create(
        model="lanegate", file=short_wav, response_format="verbose_json",
        timestamp_granularities=["word", "segment"])
    assert both.words
    assert both.segments


def test_short_audio_uses_the_realtime_lane(client: OpenAI, short_wav: Path,
                                            stack: Stack) -> None:
    before = len(list_jobs(stack))
    raw = client.audio.transcriptions.with_raw_response.create(model="lanegate",
                                                               file=short_wav)
    assert raw.headers["X-Lanegate-Lane"] == "realtime"
    assert "X-Lanegate-Job-Id" not in raw.headers
    assert len(list_jobs(stack)) == before


def test_long_audio_waits_for_a_batch_job(client: OpenAI, long_wav: Path,
                                          stack: Stack) -> None:
    raw = client.audio.transcriptions.with_raw_response.create(
        model="lanegate", file=long_wav, response_format="verbose_json")
    job_id = raw.headers["X-Lanegate-Job-Id"]
    result = raw.parse()
    assert result.duration > SYNC_MAX_S
    assert overlap(LONG, result.text) >= MOST, result.text
    assert result.segments
    jobs = {j["id"]: j for j in list_jobs(stack)}
    assert jobs[job_id]["status"] == "completed"


def test_timeout_names_the_job_and_is_not_retried(client: OpenAI, long_wav: Path,
                                                  stack: Stack) -> None:
    before = len(list_jobs(stack))
    with stack.paused("batch"), pytest.raises(openai.APIStatusError) as info:
        client.audio.transcriptions.create(model="lanegate", file=long_wav)
    assert info.value.status_code == 504
    error = info.value.body
    assert isinstance(error, dict)
    assert error["code"] == "timeout"
    assert error["type"] == "server_error"
    job_id = info.value.response.headers["X-Lanegate-Job-Id"]
    assert job_id in error["message"]
    assert len(list_jobs(stack)) == before + 1  # x-should-retry: false, one job only


def test_wrong_key_is_an_authentication_error(stack: Stack, short_wav: Path) -> None:
    with OpenAI(base_url=f"{stack.url}/v1", api_key="wrong", max_retries=0) as sdk, \
            pytest.raises(openai.AuthenticationError) as info:
        sdk.audio.transcriptions.create(model="lanegate", file=short_wav)
    body = info.value.body
    assert isinstance(body, dict)
    assert body["code"] == "invalid_api_key"
    assert body["type"] == "invalid_request_error"


def test_unsupported_file_is_an_openai_style_415(client: OpenAI, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not audio at all\n" * 40)
    with pytest.raises(openai.APIStatusError) as info:
        client.audio.transcriptions.create(model="lanegate", file=notes)
    assert info.value.status_code == 415
    body = info.value.body
    assert isinstance(body, dict)
    assert set(body) == {"message", "type", "param", "code"}
    assert body["code"] == "unsupported_format"
    assert body["param"] == "file"


def test_damaged_file_is_422(client: OpenAI, short_wav: Path, tmp_path: Path) -> None:
    whole = encode(short_wav, "m4a", tmp_path).read_bytes()
    cut = tmp_path / "cut.m4a"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.audio.transcriptions.create(model="lanegate", file=cut)
    assert "damaged mp4" in str(info.value)


def test_granularities_need_verbose_json(client: OpenAI, short_wav: Path) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.transcriptions.create(model="lanegate", file=short_wav,
                                           response_format="json",
                                           timestamp_granularities=["word"])
    assert isinstance(info.value.body, dict)
    assert info.value.body["param"] == "timestamp_granularities"


def test_prompt_and_temperature_are_accepted(client: OpenAI, short_wav: Path) -> None:
    result = client.audio.transcriptions.create(model="lanegate", file=short_wav,
                                                prompt="Meeting notes.", temperature=0.2)
    assert overlap(SHORT, result.text) >= MOST


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({}, "model"),
        ({"model": "lanegate", "temperature": "7"}, "temperature"),
        ({"model": "lanegate", "response_format": "docx"}, "response_format"),
        ({"model": "lanegate", "language": "English!"}, "language"),
        ({"model": "lanegate", "stream": "true", "response_format": "srt"}, "stream"),
        ({"model": "lanegate", "stream": "maybe"}, "stream"),
    ],
)
async def test_invalid_fields_are_400(fields: dict[str, str], param: str, stack: Stack,
                                      short_bytes: bytes) -> None:
    form = aiohttp.FormData()
    for name, value in fields.items():
        form.add_field(name, value)
    form.add_field("file", short_bytes, filename="a.wav", content_type="audio/wav")
    async with aiohttp.ClientSession() as http, http.post(
            f"{stack.url}/v1/audio/transcriptions", data=form,
            headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["error"]["param"] == param
    assert body["error"]["type"] == "invalid_request_error"


def test_wait_ends_before_the_sdk_timeout(client: OpenAI, long_wav: Path, stack: Stack) -> None:
    """The server would wait 11 s; an SDK that reads for 5 s gets the 504 (and the job
    id) first, instead of timing out and retrying, which would queue the audio again."""
    before = len(list_jobs(stack))
    impatient = client.with_options(timeout=5.0)
    with stack.paused("batch"), pytest.raises(openai.APIStatusError) as info:
        impatient.audio.transcriptions.create(model="lanegate", file=long_wav)
    assert info.value.status_code == 504
    assert len(list_jobs(stack)) == before + 1

