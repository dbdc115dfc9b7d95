"""``POST /v1/audio/transcriptions`` with ``stream=true`` through the official ``openai``
SDK, on a real stack: server-sent deltas from the realtime lane (audio up to 8 s) and
from a batch job's progress (longer audio). The job wait is generous: a loaded
machine may take a while to start the job, and the stream says nothing until then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from openai import OpenAI
from phrases import MOST, SHORT, THREE
from phrases import recall as overlap
from stack import Stack, start_stack

KEY = "openai-stream-key"
LONG = THREE  # about 10.5 s: over SYNC_MAX_S, a batch job
SYNC_MAX_S = 8.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = start_stack(tmp_path_factory.mktemp("openai-stream"), settings={
        "LANEGATE_API_KEYS": KEY,
        "LANEGATE_SYNC_MAX_SECONDS": str(SYNC_MAX_S),
        "LANEGATE_WAIT_BASE_S": "120",
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


def streamed(client: OpenAI, wav: Path) -> tuple[dict[str, str], list[object]]:
    """The response headers and the events of a ``stream=True`` transcription."""
    raw = client.audio.transcriptions.with_raw_response.create(
        model="gpt-4o-mini-transcribe", file=wav, stream=True)
    assert raw.headers["content-type"].startswith("text/event-stream")
    return dict(raw.headers), list(raw.parse())


def test_stream_sends_a_delta_per_segment_then_the_text(client: OpenAI,
                                                         short_wav: Path) -> None:
    headers, events = streamed(client, short_wav)
    assert headers["x-lanegate-lane"] == "realtime"
    *deltas, done = events
    assert [e.type for e in deltas] == ["transcript.text.delta"] * len(deltas)  # type: ignore[attr-defined]
    assert len(deltas) >= 2  # SHORT is two sentences: two segments
    assert done.type == "transcript.text.done"  # type: ignore[attr-defined]
    assert "".join(e.delta for e in deltas) == done.text  # type: ignore[attr-defined]
    assert overlap(SHORT, done.text) >= MOST  # type: ignore[attr-defined]


def test_stream_of_long_audio_follows_the_batch_job(client: OpenAI, long_wav: Path) -> None:
    headers, events = streamed(client, long_wav)
    assert headers["x-lanegate-lane"] == "batch"
    assert headers["x-lanegate-job-id"]
    *deltas, done = events
    # three sentences, three segments, each stored with the job's progress as it lands
    # (a segment takes the batch worker far longer than the gateway's 0.25 s poll)
    assert len(deltas) >= 2
    assert "".join(e.delta for e in deltas) == done.text  # type: ignore[attr-defined]
    assert overlap(LONG, done.text) >= MOST  # type: ignore[attr-defined]
