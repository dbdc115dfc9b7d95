"""The gateway under abuse (issue 14): one client cannot starve the others, hold the
event loop, or get a 5xx / traceback out of bad input.

A whole stack (real redis-server, the gateway, a realtime and a batch worker as
subprocesses, pocketsphinx, espeak-ng speech) with short timeouts, real clients
on loopback; raw sockets where a client must send what aiohttp's client will not
(non-UTF-8 headers, a body that stalls). Tests that need other gateway settings
(auth off, a disk watermark, a starved default thread pool, many scrapes) run a
gateway in-process on the same kind of real Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
from aiohttp import web
from conftest import RedisServer, read_pcm
from hypothesis import HealthCheck, given
from hypothesis import settings as fuzz_settings
from hypothesis import strategies as st
from phrases import SENTENCE_RECALL, TRAFFIC, recall
from stack import Stack, start_stack
from wsrun import Run

from gateway.app import create_app
from lanegate.settings import Settings
from lanegate.supervisor import free_port

KEYS = ("alpha", "beta", "gamma", "delta")
IDLE_S = 2.0
WALL_S = 8.0
BODY_TIMEOUT_S = 2.0
MAX_UPLOAD = 4_000_000
MAX_PARTS = 32
#: how long a test waits for one event before it fails (not a latency assertion)
EVENT_WAIT_S = 30.0
FRAME_MS = 100

SETTINGS = {
    "LANEGATE_API_KEYS": ",".join(KEYS),
    "LANEGATE_IDLE_TIMEOUT_S": str(IDLE_S),
    "LANEGATE_MAX_SESSION_WALL_S": str(WALL_S),
    "LANEGATE_BODY_READ_TIMEOUT_S": str(BODY_TIMEOUT_S),
    "LANEGATE_MAX_UPLOAD_BYTES": str(MAX_UPLOAD),
    "LANEGATE_MAX_FORM_PARTS": str(MAX_PARTS),
    "LANEGATE_SYNC_MAX_SECONDS": "1",  # every upload of speech becomes a batch job
}
#: close codes of README's table, and the error codes each may carry
CLOSE_CODES = {1000, 1001, 1008, 1009, 1013}
ERROR_CODES = {"bad_request", "unauthorized", "overloaded", "too_large", "timeout"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("abuse-stack"), settings=SETTINGS,
                    realtime_slots=2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def speech_pcm(speech: Callable[..., Path]) -> tuple[bytes, int]:
    return read_pcm(speech(TRAFFIC))


@pytest.fixture(scope="module")
def speech_wav(speech: Callable[..., Path]) -> Path:
    return speech(TRAFFIC)


def ws_url(base: str, query: str = "sample_rate=16000") -> str:
    return base.replace("http://", "ws://") + "/v1/stream?" + query


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def gateway_log(stack: Stack) -> str:
    return (stack.workdir / "gateway.log").read_text(errors="replace")


async def collect(ws: aiohttp.ClientWebSocketResponse, run: Run) -> None:
    while True:
        msg = await ws.receive(timeout=EVENT_WAIT_S)
        if msg.type is aiohttp.WSMsgType.TEXT:
            run.events.append(json.loads(msg.data))
        elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                          aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.ERROR):
            run.close_code = ws.close_code
            return


async def ready(run: Run) -> None:
    for _ in range(600):
        if run.events or run.close_code is not None:
            return
        await asyncio.sleep(0.05)


async def stream_speech(base: str, pcm: bytes, *, key: str, speed: float = 2.0) -> Run:
    """``pcm`` (16 kHz) in 100 ms frames at ``speed`` x real time, then end; all events."""
    run = Run()
    async with aiohttp.ClientSession() as http, \
            http.ws_connect(ws_url(base), headers=bearer(key)) as ws:
        receiver = asyncio.create_task(collect(ws, run))
        step = 16000 * 2 * FRAME_MS // 1000
        for offset in range(0, len(pcm), step):
            if run.close_code is not None:
                break
            await ws.send_bytes(pcm[offset:offset + step])
            await asyncio.sleep(FRAME_MS / 1000 / speed)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.send_str('{"type":"end"}')
        await receiver
    return run


def assert_transcribed(run: Run) -> None:
    assert run.close_code == 1000, run.events
    assert run.of("done"), run.events
    assert recall(TRAFFIC, run.final_text) >= SENTENCE_RECALL, run.final_text


# --- one key cannot starve the others ------------------------------------------------------


async def test_a_trickling_stream_is_closed_although_every_frame_resets_the_idle_timer(
        stack: Stack) -> None:
    run = Run()
    started = time.monotonic()
    async with aiohttp.ClientSession() as http, \
            http.ws_connect(ws_url(stack.url), headers=bearer("delta")) as ws:
        receiver = asyncio.create_task(collect(ws, run))
        await ready(run)
        assert run.events[0]["type"] == "ready", run.events
        # one sample every 0.5 s: well inside idle_timeout_s each time, ~0 audio
        while run.close_code is None and time.monotonic() - started < 10 * IDLE_S:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.send_bytes(b"\x00\x00")
            await asyncio.sleep(0.5)
        await receiver
    assert run.close_code == 1008, run.events
    assert run.error["code"] == "timeout"
    assert "min_realtime_ratio" in run.error["message"]


async def test_a_stream_is_bounded_by_wall_time_and_gets_its_finals(
        stack: Stack, speech_pcm: tuple[bytes, int]) -> None:
    pcm, _ = speech_pcm
    looped = pcm * int(4 * WALL_S * 16000 * 2 / len(pcm) + 1)  # far more than WALL_S
    run = await stream_speech(stack.url, looped, key="gamma", speed=1.0)
    assert run.close_code == 1008, run.events
    assert run.error["code"] == "timeout"
    assert "max_session_wall_s" in run.error["message"]
    assert run.of("final"), "the finals before the wall-time bound are delivered"


async def test_one_key_gets_only_its_share_of_the_live_slots(stack: Stack) -> None:
    # two realtime slots, max_key_share 0.5: one each, though max_sessions_per_key is 16
    async with aiohttp.ClientSession() as http:
        held = await http.ws_connect(ws_url(stack.url), headers=bearer("alpha"))
        try:
            assert (await held.receive_json(timeout=EVENT_WAIT_S))["type"] == "ready"
            second = Run()
            async with http.ws_connect(ws_url(stack.url), headers=bearer("alpha")) as ws:
                await collect(ws, second)
            assert second.error["code"] == "overloaded"
            assert "max_key_share" in second.error["message"]
            assert second.close_code == 1013
            other = await http.ws_connect(ws_url(stack.url), headers=bearer("beta"))
            assert (await other.receive_json(timeout=EVENT_WAIT_S))["type"] == "ready"
            await other.close()
        finally:
            await held.close()


# --- the event loop is never held by one request -------------------------------------------


async def language_flood(boundary: str, parts: int) -> AsyncIterator[bytes]:
    piece = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"language\"\r\n\r\n"
             "\r\n").encode()
    batch = piece * 1000
    for _ in range(parts // 1000):
        yield batch
    yield f"--{boundary}--\r\n".encode()


async def test_a_flood_of_empty_form_fields_is_refused_and_spares_live_streams(
        stack: Stack, speech_pcm: tuple[bytes, int]) -> None:
    pcm, _ = speech_pcm
    boundary = "floodfloodflood"
    live = asyncio.create_task(stream_speech(stack.url, pcm, key="beta", speed=1.0))
    await asyncio.sleep(1.0)  # the live stream is under way
    async with aiohttp.ClientSession() as http, http.post(
            stack.url + "/v1/transcriptions", data=language_flood(boundary, 200_000),
            headers={**bearer("alpha"),
                     "Content-Type": f"multipart/form-data; boundary={boundary}"}) as resp:
        status, body = resp.status, await resp.json()
    assert_transcribed(await live)  # the link was not starved into worker_lost
    assert status == 400, body
    assert body["error"]["code"] == "too_many_parts"


async def test_part_headers_count_against_max_upload_bytes(stack: Stack) -> None:
    # a file just under the limit, behind 20 empty fields with 8 KB headers: the
    # headers alone are more than a form's slack, so the whole body is too large
    boundary = "b0undary"
    header = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"language\";"
              f" x=\"{'y' * 8000}\"\r\n\r\n\r\n").encode()

    async def body() -> AsyncIterator[bytes]:
        yield header * 20
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
               f"filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n").encode()
        left = MAX_UPLOAD - 10_000
        while left > 0:
            yield bytes(min(left, 65536))
            left -= 65536
        yield f"\r\n--{boundary}--\r\n".encode()

    async with aiohttp.ClientSession() as http, http.post(
            stack.url + "/v1/transcriptions", data=body(),  # chunked: no Content-Length
            headers={**bearer("alpha"),
                     "Content-Type": f"multipart/form-data; boundary={boundary}"}) as resp:
        status, error = resp.status, await resp.json()
    assert status == 413, error
    assert error["error"]["code"] == "too_large"


# --- every bad input gets the right status, never a traceback ------------------------------


async def raw_exchange(port: int, request: bytes, *, wait_s: float = EVENT_WAIT_S) -> bytes:
    """Send ``request`` bytes on a fresh connection; everything read until the close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        data = b""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                while chunk := await reader.read(65536):
                    data += chunk
                    if _ws_closed(data):
                        break
        return data
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def ws_frames(data: bytes) -> list[tuple[int, bytes]]:
    """(opcode, payload) of the server's (unmasked) frames after the 101 response."""
    _head, sep, rest = data.partition(b"\r\n\r\n")
    frames: list[tuple[int, bytes]] = []
    while sep and len(rest) >= 2:
        opcode, length = rest[0] & 0x0F, rest[1] & 0x7F
        offset = 2
        if length == 126:
            (length,) = struct.unpack("!H", rest[2:4])
            offset = 4
        elif length == 127:
            (length,) = struct.unpack("!Q", rest[2:10])
            offset = 10
        if len(rest) < offset + length:
            break
        frames.append((opcode, rest[offset:offset + length]))
        rest = rest[offset + length:]
    return frames


def _ws_closed(data: bytes) -> bool:
    return data.startswith(b"HTTP/1.1 101") and any(op == 8 for op, _ in ws_frames(data))


BAD_AUTH = b"Authorization: Bearer \xff\xfe\xfd\r\n"


async def test_a_non_utf8_authorization_header_is_401_on_rest(stack: Stack) -> None:
    data = await raw_exchange(stack.port, b"GET /v1/transcriptions HTTP/1.1\r\n"
                              b"Host: 127.0.0.1\r\nConnection: close\r\n" + BAD_AUTH + b"\r\n")
    status_line, _, rest = data.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 401"), data[:300]
    assert b'"unauthorized"' in rest


async def test_a_non_utf8_authorization_header_is_1008_on_the_stream(stack: Stack) -> None:
    data = await raw_exchange(stack.port, (
        b"GET /v1/stream?sample_rate=16000 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Upgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        + BAD_AUTH + b"\r\n"))
    frames = ws_frames(data)
    events = [json.loads(p) for op, p in frames if op == 1]
    closes = [p for op, p in frames if op == 8]
    assert events, data[:300]
    assert events[0]["code"] == "unauthorized"
    assert closes
    assert struct.unpack("!H", closes[0][:2])[0] == 1008


async def test_a_control_message_nested_100000_deep_is_bad_request_1008(stack: Stack) -> None:
    run = Run()
    async with aiohttp.ClientSession() as http, \
            http.ws_connect(ws_url(stack.url), headers=bearer("gamma")) as ws:
        receiver = asyncio.create_task(collect(ws, run))
        await ready(run)
        await ws.send_str("[" * 100_000 + "]" * 100_000)
        await receiver
    assert run.error["code"] == "bad_request"
    assert run.close_code == 1008


def test_the_worker_refuses_deeply_nested_control_messages_as_protocol_errors() -> None:
    from workers.link import ProtocolViolation, control_op
    from workers.validation import control_problem

    deep = '{"op":' * 100_000 + "1" + "}" * 100_000
    with pytest.raises(ProtocolViolation):
        control_op(deep)
    assert control_problem("[" * 100_000) == "the control message nests too deep"


async def test_a_nan_cursor_is_400(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http, http.get(
            stack.url + "/v1/transcriptions", params={"cursor": "nan:x"},
            headers=bearer("alpha")) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "invalid_cursor"


def blob_count(stack: Stack) -> int:
    return len(list(stack.blob_dir.glob("*/*"))) if stack.blob_dir.exists() else 0


async def test_a_trickling_body_is_408_and_leaves_nothing(stack: Stack) -> None:
    before = blob_count(stack)
    request = (b"POST /v1/transcriptions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Authorization: Bearer alpha\r\nContent-Type: audio/wav\r\n"
               b"Content-Length: 100000\r\n\r\nRIFF")
    data = await raw_exchange(stack.port, request, wait_s=10 * BODY_TIMEOUT_S)
    status_line, _, rest = data.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), data[:300]
    assert b'"timeout"' in rest
    assert blob_count(stack) == before


def wait_log(stack: Stack, needle: str, timeout_s: float = EVENT_WAIT_S) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in gateway_log(stack).splitlines():
            if needle in line:
                return line
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} never appeared in the gateway log")


async def test_an_openai_request_whose_client_left_stops_waiting_and_its_job_goes_on(
        stack: Stack, speech_wav: Path) -> None:
    form = wav_form(speech_wav, model="whisper-1")
    with stack.paused("batch"):  # the job stays queued: the request waits
        async with aiohttp.ClientSession() as http:
            request = asyncio.create_task(http.post(
                stack.url + "/v1/audio/transcriptions", data=form, headers=bearer("alpha")))
            waiting = await asyncio.to_thread(wait_log, stack, "openai_waiting")
            job_id = json.loads(waiting)["job_id"]
            request.cancel()  # the client hangs up
            with contextlib.suppress(asyncio.CancelledError):
                await request
        gone = await asyncio.to_thread(wait_log, stack, "openai_client_gone")
        assert job_id in gone
    async with aiohttp.ClientSession() as http:
        for _ in range(600):
            async with http.get(f"{stack.url}/v1/transcriptions/{job_id}",
                                headers=bearer("alpha")) as resp:
                job = await resp.json()
            if job["status"] in ("completed", "failed"):
                break
            await asyncio.sleep(0.1)
    assert job["status"] == "completed", job  # nothing lost
    for _ in range(100):  # and nothing left: the audio goes once the result is stored
        if not (stack.blob_dir / job_id).exists():
            break
        await asyncio.sleep(0.1)
    assert not (stack.blob_dir / job_id).exists()


# --- property-based: random input never gets a 5xx, a 1011 or a traceback -----------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)
CONTROL = st.one_of(
    JSON.map(json.dumps),
    st.builds(lambda kind, extra: json.dumps({"type": kind, **extra}),
              st.sampled_from(["end", "start", "ready", "", "END"]) | st.text(max_size=8),
              st.dictionaries(st.text(max_size=6), JSON, max_size=3)),
    st.text(max_size=80),
    st.integers(1, 200_000).map(lambda depth: "[" * depth),
    st.integers(1, 50_000).map(lambda depth: '{"a":' * depth + "1" + "}" * depth),
)
FRAME = st.one_of(
    st.binary(max_size=3200),
    st.integers(0, 70_000).map(bytes),
    st.sampled_from([1_048_576, 1_048_577, 1_500_000]).map(bytes),  # around max_frame_bytes
)
MESSAGES = st.lists(st.one_of(CONTROL.map(lambda t: ("text", t)),
                              FRAME.map(lambda b: ("binary", b))), min_size=1, max_size=6)
QUERY = st.one_of(
    st.just("sample_rate=16000"),
    st.builds(lambda rate, lang: f"sample_rate={rate}&language={lang}",
              st.sampled_from(["8000", "48000", "0", "-1", "nan", "16000.5", "", "1e9"]),
              st.sampled_from(["en", "en_US", "xx-yy-zz", "", "%00", "e" * 300])),
)
FUZZ = fuzz_settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def allowed_ending(run: Run) -> None:
    assert run.close_code in CLOSE_CODES, (run.close_code, run.events)
    for event in run.of("error"):
        assert event["code"] in ERROR_CODES, run.events


@FUZZ
@given(query=QUERY, messages=MESSAGES)
async def test_random_control_messages_and_frames_get_only_client_errors(
        stack: Stack, query: str, messages: list[tuple[str, Any]]) -> None:
    run = Run()
    async with aiohttp.ClientSession() as http, http.ws_connect(
            ws_url(stack.url, query), headers=bearer("gamma"),
            max_msg_size=0) as ws:
        receiver = asyncio.create_task(collect(ws, run))
        await ready(run)
        with contextlib.suppress(ConnectionError, RuntimeError):
            for kind, payload in messages:
                if run.close_code is not None:
                    break
                if kind == "text":
                    await ws.send_str(payload)
                else:
                    await ws.send_bytes(payload)
            if run.close_code is None:
                await ws.send_str('{"type":"end"}')
        await receiver
    allowed_ending(run)


FIELD_NAMES = st.sampled_from(["file", "language", "response_format", "async", "webhook_url",
                               "model", "temperature", "stream", "timestamp_granularities[]",
                               "zzz", ""])
PART = st.tuples(FIELD_NAMES, st.binary(max_size=400),
                 st.sampled_from([None, "audio/wav", "text/plain; charset=klingon",
                                  "application/octet-stream"]),
                 st.sampled_from([None, "a.wav", "../../etc/passwd", "\\x\\y.mp3", ""]))
CONTENT_TYPES = st.sampled_from(["multipart/form-data; boundary=BOUNDARY", "multipart/form-data",
                                 "multipart/mixed; boundary=BOUNDARY", "audio/wav",
                                 "text/plain", "application/json", ""])


def multipart(parts: list[tuple[str, bytes, str | None, str | None]], wav: bytes | None,
              tail: bytes) -> bytes:
    body = b""
    for name, value, content_type, filename in parts:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        body += f"--BOUNDARY\r\nContent-Disposition: {disposition}\r\n".encode()
        if content_type:
            body += f"Content-Type: {content_type}\r\n".encode()
        body += b"\r\n" + (wav if name == "file" and wav is not None else value) + b"\r\n"
    return body + tail


@FUZZ
@given(route=st.sampled_from(["/v1/transcriptions", "/v1/audio/transcriptions"]),
       content_type=CONTENT_TYPES, parts=st.lists(PART, max_size=6),
       wav_cut=st.none() | st.integers(0, 20_000),
       tail=st.sampled_from([b"--BOUNDARY--\r\n", b"", b"--BOUNDARY", b"garbage\r\n\r\n"]),
       junk=st.none() | st.binary(max_size=600))
async def test_random_multipart_uploads_get_only_client_errors(
        stack: Stack, speech_wav: Path, route: str, content_type: str,
        parts: list[tuple[str, bytes, str | None, str | None]], wav_cut: int | None,
        tail: bytes, junk: bytes | None) -> None:
    wav = None if wav_cut is None else (await asyncio.to_thread(speech_wav.read_bytes))[:wav_cut]
    body = junk if junk is not None else multipart(parts, wav, tail)
    headers = {**bearer("gamma"), "Content-Type": content_type}
    async with aiohttp.ClientSession() as http, http.post(
            stack.url + route, data=body, headers=headers) as resp:
        status, text = resp.status, await resp.text()
    assert status < 500, (status, text)
    if status >= 400:
        assert "error" in json.loads(text)


async def test_after_the_fuzzing_a_normal_session_still_gets_its_final(
        stack: Stack, speech_pcm: tuple[bytes, int]) -> None:
    pcm, _ = speech_pcm
    assert_transcribed(await stream_speech(stack.url, pcm, key="beta"))


def test_no_traceback_in_the_gateway_log(stack: Stack) -> None:
    log = gateway_log(stack)
    assert "Traceback" not in log
    assert "internal_error" not in log


# --- gateways with other settings, in-process ----------------------------------------------


@contextlib.asynccontextmanager
async def gateway(settings: Settings) -> AsyncIterator[str]:
    """The gateway app served on a free loopback port in this loop; its base URL."""
    port = free_port()
    runner = web.AppRunner(create_app(settings.replace(port=port)),
                           handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def wav_form(path: Path, **fields: str) -> aiohttp.FormData:
    form = aiohttp.FormData()
    for name, value in fields.items():
        form.add_field(name, value)
    form.add_field("file", path.read_bytes(), filename="a.wav", content_type="audio/wav")
    return form


async def test_below_the_free_space_watermark_uploads_are_507(
        redis_server: RedisServer, tmp_path: Path, speech_wav: Path) -> None:
    settings = Settings(redis_url=redis_server.url, data_dir=str(tmp_path),
                        min_free_disk="100%")  # more than any disk has free
    async with gateway(settings) as base, aiohttp.ClientSession() as http, http.post(
            base + "/v1/transcriptions",
            data=wav_form(speech_wav, **{"async": "true"})) as resp:
        status, body = resp.status, await resp.json()
        retry_after = resp.headers.get("Retry-After")
    assert status == 507, body
    assert body["error"]["code"] == "insufficient_storage"
    assert retry_after is not None
    assert not list((tmp_path / "blobs").glob("*/*"))


async def test_uploads_and_webhook_lookups_do_not_need_the_default_thread_pool(
        redis_server: RedisServer, tmp_path: Path, speech_wav: Path) -> None:
    loop = asyncio.get_running_loop()
    default = ThreadPoolExecutor(max_workers=2)
    loop.set_default_executor(default)
    release = threading.Event()
    # every default thread is busy (as with six long decodes there before)
    blockers = [loop.run_in_executor(None, release.wait) for _ in range(2)]
    settings = Settings(redis_url=redis_server.url, data_dir=str(tmp_path),
                        webhook_secret="s", webhook_allow_private=True)
    try:
        async with gateway(settings) as base, aiohttp.ClientSession() as http:
            async with asyncio.timeout(EVENT_WAIT_S):
                async with http.post(base + "/v1/transcriptions", data=wav_form(
                        speech_wav, webhook_url="http://localhost:9/hook")) as resp:
                    status, body = resp.status, await resp.json()
        assert status == 202, body
        assert body["status"] == "queued"
    finally:
        release.set()
        await asyncio.gather(*blockers)


async def test_anonymous_streams_are_limited_per_client_address(
        stack: Stack, tmp_path: Path) -> None:
    # auth off, on the stack's Redis and realtime worker; one session per address
    settings = Settings(redis_url=stack.redis.url, data_dir=str(tmp_path),
                        max_sessions_per_key=1)
    async with gateway(settings) as base, aiohttp.ClientSession() as http:
        held = await http.ws_connect(ws_url(base))
        try:
            assert (await held.receive_json(timeout=EVENT_WAIT_S))["type"] == "ready"
            second = Run()
            async with http.ws_connect(ws_url(base)) as ws:
                await collect(ws, second)
            assert second.error["code"] == "overloaded"
            assert "client address" in second.error["message"]
            assert second.close_code == 1013
        finally:
            await held.close()


async def test_metrics_scrapes_share_one_read_of_the_job_stream(
        redis_server: RedisServer, tmp_path: Path) -> None:
    client = redis.Redis(port=redis_server.port)

    def xinfo_calls() -> int:
        stats = client.info("commandstats")
        return int(stats.get("cmdstat_xinfo|groups", {}).get("calls", 0))

    settings = Settings(redis_url=redis_server.url, data_dir=str(tmp_path),
                        metrics_cache_s=60.0)
    async with gateway(settings) as base, aiohttp.ClientSession() as http:
        before = xinfo_calls()
        for _ in range(20):
            async with http.get(base + "/metrics") as resp:
                assert resp.status == 200
                assert "lanegate_queue_depth" in await resp.text()
        assert xinfo_calls() - before <= 1
    client.close()

