"""``language`` end to end with the real Whisper base engine in a whole stack: a client
that names no language gets the one Whisper detects, on the OpenAI endpoint
(``verbose_json``), on a live stream (each final's ``language``) and in an async job's
result; and ``/v1/audio/translations`` (Whisper's translate task) through the SDK's
``audio.translations.create``. espeak-ng speaks Spanish and German; the model is
assembled once per test session (``whisper_data``) and each worker of the one stack
loads it once."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio
from conftest import read_pcm, synthesize
from openai import OpenAI
from phrases import recall, spoken
from stack import Stack, start_stack
from wsrun import Run

from engines import models

KEY = "language-key"
SPANISH = "vamos a la playa con nuestros amigos y comemos pescado"
#: Whisper base takes some espeak-ng German for English or Latvian; this sentence it
#: detects and mostly gets right (recall 0.75)
GERMAN = "guten morgen, ich wohne seit vielen jahren in berlin und arbeite dort"
#: a prompt about the topic, none of whose words the recording says: Whisper takes a
#: prompt for text already transcribed, and one that repeats the recording's first
#: words may make it skip them ("Vamos a la playa." once gave "Con nuestros amigos...")
PROMPT = "Un día de verano en la costa."
#: espeak-ng's Spanish and German are robotic; Whisper base still gets most words
SENSIBLE = 0.5
EVENT_WAIT_S = 60.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, whisper_data: Path) -> Iterator[Stack]:
    running = start_stack(tmp_path_factory.mktemp("language-stack"), settings={
        "LANEGATE_API_KEYS": KEY,
        "LANEGATE_ENGINE": "whisper",
        "LANEGATE_WHISPER_MODEL": str(models.resolve("base", str(whisper_data))),
        "LANEGATE_SLOTS": "2",
        "LANEGATE_UPLOAD_RESERVE_SLOTS": "0",
    }, realtime_slots=2)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def spanish_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize(SPANISH, tmp_path_factory.mktemp("es") / "es.wav", voice="es")


@pytest.fixture(scope="module")
def german_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize(GERMAN, tmp_path_factory.mktemp("de") / "de.wav", voice="de")


@pytest_asyncio.fixture
async def http(stack: Stack) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=stack.url,
                                     headers={"Authorization": f"Bearer {KEY}"}) as session:
        yield session


def test_openai_sdk_verbose_json_reports_the_detected_language(stack: Stack,
                                                                spanish_wav: Path) -> None:
    with OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0) as sdk, \
            spanish_wav.open("rb") as audio:
        result = sdk.audio.transcriptions.create(model="whisper-1", file=audio,
                                                 response_format="verbose_json")
    assert result.language == "spanish", result
    assert recall(SPANISH, result.text) >= SENSIBLE, result.text


async def test_a_stream_without_language_gets_finals_in_the_detected_one(
        http: aiohttp.ClientSession, stack: Stack, spanish_wav: Path) -> None:
    pcm, rate = read_pcm(spanish_wav)
    run = Run()
    url = stack.url.replace("http://", "ws://") + f"/v1/stream?sample_rate={rate}"
    async with http.ws_connect(url) as ws:
        step = rate * 2 // 10  # 100 ms frames, sent as fast as the socket takes them
        for offset in range(0, len(pcm), step):
            await ws.send_bytes(pcm[offset:offset + step])
        await ws.send_str('{"type":"end"}')
        while (msg := await ws.receive(timeout=EVENT_WAIT_S)).type is aiohttp.WSMsgType.TEXT:
            run.events.append(json.loads(msg.data))
    finals = run.of("final")
    assert finals, run.events
    assert {f["language"] for f in finals} == {"es"}, finals
    assert recall(SPANISH, run.final_text) >= SENSIBLE, run.final_text


async def test_an_async_job_without_language_reports_the_detected_one(
        http: aiohttp.ClientSession, german_wav: Path) -> None:
    audio = await asyncio.to_thread(german_wav.read_bytes)
    form = aiohttp.FormData()
    form.add_field("async", "true")
    form.add_field("file", audio, filename="de.wav",
                   content_type="audio/wav")
    async with http.post("/v1/transcriptions", data=form) as resp:
        assert resp.status == 202, await resp.text()
        job_id = resp.headers["Location"].rsplit("/", 1)[1]
    for _ in range(1200):
        async with http.get(f"/v1/transcriptions/{job_id}") as resp:
            job = await resp.json()
        if job["status"] in ("completed", "failed", "cancelled"):
            break
        await asyncio.sleep(0.1)
    assert job["status"] == "completed", job
    assert job["language"] == "de", job
    async with http.get(f"/v1/transcriptions/{job_id}", params={"format": "json"}) as resp:
        transcript = await resp.json()
    assert transcript["language"] == "de", transcript
    assert recall(GERMAN, transcript["text"]) >= SENSIBLE, transcript["text"]


def test_an_explicit_language_prompt_and_temperature_are_taken(stack: Stack,
                                                               spanish_wav: Path) -> None:
    with OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0) as sdk, \
            spanish_wav.open("rb") as audio:
        result = sdk.audio.transcriptions.create(
            model="whisper-1", file=audio, response_format="verbose_json", language="es-ES",
            prompt=PROMPT, temperature=0.0)  # sampling above 0 is random
    assert result.language == "spanish", result
    assert recall(SPANISH, result.text) >= SENSIBLE, result.text


#: Whisper base translates this espeak-ng Spanish into "... I like the coffee very much."
#: (measured at the fixture's pace; it is weak at translation, and some other sentences
#: come back empty or off: "Muchas gracias por su ayuda" gave "many free sports and one")
TO_TRANSLATE = "Buenos días. Me gusta mucho el café."


@pytest.fixture(scope="module")
def to_translate_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize(TO_TRANSLATE, tmp_path_factory.mktemp("es-tr") / "es.wav", voice="es")


def _english(text: str) -> None:
    words = set(re.findall(r"[a-z]+", text.lower()))
    assert {"like", "coffee"} <= words, text
    assert not words & {"gusta", "mucho", "caf"}, text  # not the Spanish transcript


@pytest.mark.parametrize("fmt", ["json", "text", "srt", "vtt", "verbose_json"])
def test_openai_sdk_translations_come_back_in_english(stack: Stack, to_translate_wav: Path,
                                                       fmt: str) -> None:
    with OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0) as sdk, \
            to_translate_wav.open("rb") as audio:
        result = sdk.audio.translations.create(model="whisper-1", file=audio,
                                               response_format=fmt)  # type: ignore[call-overload]
    if fmt == "json":
        _english(result.text)
    elif fmt == "verbose_json":
        assert (result.task, result.language) == ("translate", "english"), result
        assert result.segments, result
        assert result.duration > 2, result
        _english(result.text)
        _english(" ".join(s.text for s in result.segments))
    else:
        assert isinstance(result, str), result
        _english(result)
        if fmt != "text":
            assert "-->" in result, result
            assert result.startswith("1\n") == (fmt == "srt"), result


def test_a_long_translation_is_a_batch_job_and_still_english(
        stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Over ``sync_max_seconds`` (30 s): the task rides the job hash to the batch worker."""
    long_wav = synthesize(spoken(*[TO_TRANSLATE] * 8),
                          tmp_path_factory.mktemp("es-long") / "es.wav", voice="es")
    with OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0) as sdk, \
            long_wav.open("rb") as audio:
        raw = sdk.audio.translations.with_raw_response.create(model="whisper-1", file=audio)
    assert raw.headers["X-Lanegate-Lane"] == "batch"
    text = raw.parse().text
    words = re.findall(r"[a-z]+", text.lower())
    assert words.count("coffee") >= 4, text  # most of the eight sentences, in English
    assert "gusta" not in words, text


def test_the_same_audio_transcribed_stays_spanish(stack: Stack, to_translate_wav: Path) -> None:
    with OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0) as sdk, \
            to_translate_wav.open("rb") as audio:
        result = sdk.audio.transcriptions.create(model="whisper-1", file=audio)
    assert {"gusta", "mucho"} <= set(re.findall(r"[a-z]+", result.text.lower())), result.text


def test_a_translation_refuses_an_unknown_format_in_openai_shape(stack: Stack,
                                                                 to_translate_wav: Path) -> None:
    with OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0) as sdk, \
            to_translate_wav.open("rb") as audio, pytest.raises(openai.BadRequestError) as bad:
        sdk.audio.translations.create(model="whisper-1", file=audio,
                                      response_format="mp3")  # type: ignore[call-overload]
    assert (bad.value.code, bad.value.param) == ("invalid_response_format", "response_format"), \
        bad.value.body
