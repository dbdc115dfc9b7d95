"""``/v1/stream`` end to end: real redis-server, the gateway and realtime workers as
subprocesses started like ``lanegate up`` starts them, real pocketsphinx, real
espeak-ng speech, a real aiohttp WebSocket client."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
from conftest import read_pcm
from phrases import SENTENCE_RECALL, TALKING, TRAFFIC, recall
from stack import Stack, start_stack
from wsrun import Run

from gateway.auth import tenant_id
from lanegate.constants import KEY_SESSIONS_KEY

ONE = TRAFFIC
TWO = TALKING
KEYS = ("alpha", "beta", "gamma")
MAX_FRAME = 64_000
FRAME_MS = 100
#: how long a test waits for one event before it fails (not a latency assertion)
EVENT_WAIT_S = 30.0

SETTINGS = {
    "LANEGATE_API_KEYS": ",".join(KEYS),
    "LANEGATE_MAX_SESSIONS_PER_KEY": "1",
    "LANEGATE_MAX_FRAME_BYTES": str(MAX_FRAME),
    "LANEGATE_MAX_SESSION_S": "8",
    "LANEGATE_IDLE_TIMEOUT_S": "2",
}


def stream_url(stack: Stack, query: str = "sample_rate=16000") -> str:
    return stack.url.replace("http://", "ws://") + "/v1/stream?" + query


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def key_free(stack: Stack, key: str | None) -> None:
    """Wait until ``key`` holds no stream lease: a server-side close reaches the client a
    moment before the gateway releases the lease (max_sessions_per_key is 1 here)."""
    if key not in KEYS:
        return
    client = redis.Redis(port=stack.redis.port)
    try:
        for _ in range(200):
            if not client.zcard(KEY_SESSIONS_KEY.format(tenant=tenant_id(key))):
                return
            await asyncio.sleep(0.025)
    finally:
        client.close()


async def collect(ws: aiohttp.ClientWebSocketResponse, run: Run) -> None:
    while True:
        msg = await ws.receive(timeout=EVENT_WAIT_S)
        if msg.type is aiohttp.WSMsgType.TEXT:
            run.events.append(json.loads(msg.data))
        elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                          aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.ERROR):
            run.close_code = ws.close_code
            return


async def stream_speech(http: aiohttp.ClientSession, stack: Stack, pcm: bytes, rate: int, *,
                        key: str | None = "alpha", speed: float = 2.0,
                        heartbeat: float | None = None) -> Run:
    """Send ``pcm`` in 100 ms frames at ``speed`` x real time, then end; all events.
    ``heartbeat``: the client pings this often and drops a socket that does not pong."""
    run = Run()
    await key_free(stack, key)
    async with http.ws_connect(stream_url(stack, f"sample_rate={rate}"),
                               headers=auth(key), heartbeat=heartbeat) as ws:
        receiver = asyncio.create_task(collect(ws, run))
        step = rate * 2 * FRAME_MS // 1000
        for offset in range(0, len(pcm), step):
            await ws.send_bytes(pcm[offset:offset + step])
            if speed:
                await asyncio.sleep(FRAME_MS / 1000 / speed)
        run.partials_before_end = len(run.of("partial"))
        await ws.send_str('{"type":"end"}')
        await receiver
    return run


async def one_shot(http: aiohttp.ClientSession, url: str, *, headers: dict[str, str],
                   send: Callable[[aiohttp.ClientWebSocketResponse], Any] | None = None,
                   free: tuple[Stack, str] | None = None) -> Run:
    """Open a stream (first waiting, with ``free``, for that key's last lease to go),
    optionally send something, and collect until the close."""
    run = Run()
    if free is not None:
        await key_free(*free)
    async with http.ws_connect(url, headers=headers) as ws:
        receiver = asyncio.create_task(collect(ws, run))
        if send is not None:
            for _ in range(50):  # wait for ready before sending
                if run.events:
                    break
                await asyncio.sleep(0.05)
            await send(ws)
        await receiver
    return run


def metric_value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def stream_end_of(stack: Stack, session_id: str) -> dict[str, Any]:
    """The gateway's one ``stream_end`` log record of ``session_id`` (waits for it)."""
    deadline = time.monotonic() + EVENT_WAIT_S
    while time.monotonic() < deadline:
        text = (stack.workdir / "gateway.log").read_text(errors="replace")
        ends = [record for line in text.splitlines() if session_id in line
                and (record := json.loads(line)).get("event") == "stream_end"]
        if ends:
            assert len(ends) == 1, ends
            return ends[0]
        time.sleep(0.1)
    raise AssertionError(f"no stream_end logged for {session_id}")


def get(url: str) -> tuple[int, dict[str, Any] | str, dict[str, str]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = resp.read().decode()
            status, headers = resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        body = exc.read().decode()
        status, headers = exc.code, dict(exc.headers)
    except OSError:  # refused: a dead process
        return 0, "", {}
    try:
        return status, json.loads(body), headers
    except ValueError:
        return status, body, headers


# --- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("stream-stack"), settings=SETTINGS, batch=False,
                    realtime_slots=2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def one(speech: Callable[..., Path]) -> tuple[bytes, int]:
    return read_pcm(speech(ONE))


@pytest.fixture(scope="module")
def two(speech: Callable[..., Path]) -> tuple[bytes, int]:
    return read_pcm(speech(TWO))


# --- the happy path ----------------------------------------------------------------------


async def test_speech_streams_partials_while_sending_and_finals_with_the_words(
    stack: Stack, http: aiohttp.ClientSession, one: tuple[bytes, int]
) -> None:
    pcm, rate = one
    run = await stream_speech(http, stack, pcm, rate)
    ready = run.events[0]
    assert ready["type"] == "ready"
    assert ready["lane"] == "realtime"
    assert ready["sample_rate"] == rate
    assert re.fullmatch(r"[0-9a-f]{32}", ready["session_id"])
    assert run.partials_before_end > 0, "no partial arrived while audio was being sent"
    assert recall(ONE, run.final_text) >= SENTENCE_RECALL, run.final_text
    assert run.events[-1] == {"type": "done"}
    assert run.close_code == 1000
    audio_ms = len(pcm) / (rate * 2) * 1000
    ends = [e["audio_end_ms"] for e in run.of("partial")]
    assert ends == sorted(ends)
    assert all(0 < end <= audio_ms + 1 for end in ends)
    for final in run.of("final"):
        assert {"segment", "text", "start_ms", "end_ms", "cut"} <= final.keys()
        assert final["cut"] in ("endpoint", "max_window", "end")
    # the operator's log says how it ended, though the client hung up right after the close
    end = await asyncio.to_thread(stream_end_of, stack, ready["session_id"])
    assert end["outcome"] == "done", end
    assert end["audio_s"] == pytest.approx(audio_ms / 1000, abs=0.01)


async def test_a_client_that_pings_keeps_its_stream_and_its_words(
    stack: Stack, http: aiohttp.ClientSession, one: tuple[bytes, int]
) -> None:
    """Pings between audio frames are answered (aiohttp's client drops a socket whose
    pong is late: half the heartbeat) and no frame is lost around them."""
    pcm, rate = one
    run = await stream_speech(http, stack, pcm, rate, heartbeat=0.3)
    assert run.events[-1] == {"type": "done"}, run.events[-3:]
    assert run.close_code == 1000
    assert recall(ONE, run.final_text) >= SENTENCE_RECALL, run.final_text
    end = await asyncio.to_thread(stream_end_of, stack, run.events[0]["session_id"])
    assert end["audio_s"] == pytest.approx(len(pcm) / (rate * 2), abs=0.01)


async def test_two_concurrent_sessions_get_their_own_text(
    stack: Stack, http: aiohttp.ClientSession, one: tuple[bytes, int], two: tuple[bytes, int]
) -> None:
    run_one, run_two = await asyncio.gather(
        stream_speech(http, stack, *one, key="alpha"),
        stream_speech(http, stack, *two, key="beta"),
    )
    assert recall(ONE, run_one.final_text) >= SENTENCE_RECALL, run_one.final_text
    assert recall(TWO, run_two.final_text) >= SENTENCE_RECALL, run_two.final_text
    assert recall(ONE, run_one.final_text) > recall(ONE, run_two.final_text)
    assert recall(TWO, run_two.final_text) > recall(TWO, run_one.final_text)
    assert run_one.of("ready")[0]["session_id"] != run_two.of("ready")[0]["session_id"]


async def test_telephony_rate_is_accepted_and_transcribed(
    stack: Stack, http: aiohttp.ClientSession, speech: Callable[..., Path]
) -> None:
    pcm, rate = read_pcm(speech(ONE, rate=8000))
    run = await stream_speech(http, stack, pcm, rate, speed=0)
    assert run.of("ready")[0]["sample_rate"] == 8000
    assert run.final_text.strip()  # recognition quality per rate is the engine tests' job
    assert run.close_code == 1000


# --- auth and limits -----------------------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, auth("wrong"), {"Authorization": "Basic alpha"}])
async def test_missing_or_wrong_key_is_unauthorized_1008(
    stack: Stack, http: aiohttp.ClientSession, headers: dict[str, str]
) -> None:
    run = await one_shot(http, stream_url(stack), headers=headers)
    assert run.error["code"] == "unauthorized"
    assert run.close_code == 1008
    assert not run.of("ready")


async def test_api_key_in_the_query_is_accepted(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    async def end(ws: aiohttp.ClientWebSocketResponse) -> None:
        await ws.send_str('{"type":"end"}')

    run = await one_shot(http, stream_url(stack, "sample_rate=16000&api_key=gamma"),
                         headers={}, send=end, free=(stack, "gamma"))
    assert run.events[0]["type"] == "ready"
    assert run.events[-1] == {"type": "done"}
    assert run.close_code == 1000


@pytest.mark.parametrize("language", ["en", "en-US", "en_US"])
async def test_language_tags_like_the_uploads_take(
    stack: Stack, http: aiohttp.ClientSession, language: str
) -> None:
    async def end(ws: aiohttp.ClientWebSocketResponse) -> None:
        await ws.send_str('{"type":"end"}')

    run = await one_shot(http, stream_url(stack, f"sample_rate=16000&language={language}"),
                         headers=auth("gamma"), send=end, free=(stack, "gamma"))
    assert run.events[0]["type"] == "ready"
    assert run.events[-1] == {"type": "done"}


@pytest.mark.parametrize("query", ["sample_rate=7999", "sample_rate=48001",
                                   "sample_rate=abc", "sample_rate=16000&language=e%20n"])
async def test_bad_query_is_bad_request_1008(
    stack: Stack, http: aiohttp.ClientSession, query: str
) -> None:
    run = await one_shot(http, stream_url(stack, query), headers=auth("alpha"),
                         free=(stack, "alpha"))
    assert run.error["code"] == "bad_request"
    assert run.close_code == 1008


async def _hold(http: aiohttp.ClientSession, stack: Stack, key: str
                ) -> aiohttp.ClientWebSocketResponse:
    await key_free(stack, key)
    ws = await http.ws_connect(stream_url(stack), headers=auth(key))
    msg = await ws.receive(timeout=EVENT_WAIT_S)
    assert json.loads(msg.data)["type"] == "ready", msg.data
    return ws


async def test_per_key_session_limit_spans_the_key_and_frees_on_close(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    held = await _hold(http, stack, "alpha")
    try:
        run = await one_shot(http, stream_url(stack), headers=auth("alpha"))
        assert run.error["code"] == "overloaded"
        assert "max_sessions_per_key" in run.error["message"]
        assert run.close_code == 1013
        other = await _hold(http, stack, "beta")  # another key is not affected
        await other.close()
    finally:
        await held.close()
    for _ in range(100):  # the gateway releases the lease when it sees the close
        client = redis.Redis(port=stack.redis.port)
        keys = client.keys("lanegate:sessions:*")
        counts = [client.zcard(k) for k in keys]
        client.close()
        if not any(counts):
            break
        await asyncio.sleep(0.05)
    again = await _hold(http, stack, "alpha")
    await again.close()


async def test_all_slots_busy_is_overloaded_1013_at_once(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    before = get(stack.url + "/metrics")[1]
    assert isinstance(before, str)
    first = await _hold(http, stack, "alpha")
    second = await _hold(http, stack, "beta")
    try:
        run = await one_shot(http, stream_url(stack), headers=auth("gamma"),
                             free=(stack, "gamma"))
        assert run.error["code"] == "overloaded"
        assert run.close_code == 1013
    finally:
        await first.close()
        await second.close()
    after = get(stack.url + "/metrics")[1]
    assert isinstance(after, str)
    assert (metric_value(after, "lanegate_rejections_total", reason="overloaded")
            > metric_value(before, "lanegate_rejections_total", reason="overloaded"))


# --- bad input ----------------------------------------------------------------------------


BAD_INPUTS: dict[str, Callable[[aiohttp.ClientWebSocketResponse], Any]] = {}


def _bad(name: str) -> Callable[[Callable[[aiohttp.ClientWebSocketResponse], Any]], Any]:
    def register(fn: Callable[[aiohttp.ClientWebSocketResponse], Any]) -> Any:
        BAD_INPUTS[name] = fn
        return fn
    return register


@_bad("bad_json")
async def _bad_json(ws: aiohttp.ClientWebSocketResponse) -> None:
    await ws.send_str("{not json")


@_bad("unknown_type")
async def _unknown_type(ws: aiohttp.ClientWebSocketResponse) -> None:
    await ws.send_str('{"type":"pause"}')


@_bad("not_an_object")
async def _not_an_object(ws: aiohttp.ClientWebSocketResponse) -> None:
    await ws.send_str("[1, 2, 3]")


@_bad("odd_byte_count")
async def _odd(ws: aiohttp.ClientWebSocketResponse) -> None:
    await ws.send_bytes(b"\x00" * 3201)


@_bad("text_where_audio_belongs")
async def _text_audio(ws: aiohttp.ClientWebSocketResponse) -> None:
    await ws.send_str("RIFF$\x00\x00\x00WAVEfmt " + "\x00" * 64)


@_bad("audio_after_end")
async def _after_end(ws: aiohttp.ClientWebSocketResponse) -> None:
    await ws.send_str('{"type":"end"}')
    await ws.send_bytes(b"\x00" * 3200)


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
async def test_bad_input_is_bad_request_1008_and_spares_other_sessions(
    stack: Stack, http: aiohttp.ClientSession, two: tuple[bytes, int], case: str
) -> None:
    bystander = asyncio.create_task(stream_speech(http, stack, *two, key="beta", speed=4.0))
    run = await one_shot(http, stream_url(stack), headers=auth("alpha"),
                         send=BAD_INPUTS[case], free=(stack, "alpha"))
    if case == "audio_after_end" and run.events[-1] == {"type": "done"}:
        # the worker may finish the empty stream before the late audio arrives
        assert run.close_code == 1000
    else:
        assert run.error["code"] == "bad_request", run.events
        assert run.close_code == 1008
    other = await bystander
    assert other.events[-1] == {"type": "done"}
    assert other.final_text.strip()


async def test_frame_over_max_frame_bytes_is_too_large_1009(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    async def big(ws: aiohttp.ClientWebSocketResponse) -> None:
        await ws.send_bytes(b"\x00" * (MAX_FRAME + 2))

    run = await one_shot(http, stream_url(stack), headers=auth("alpha"), send=big,
                         free=(stack, "alpha"))
    assert run.error["code"] == "too_large"
    assert run.close_code == 1009


async def test_frame_over_the_hard_cap_is_closed_1009_at_the_header(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    async def huge(ws: aiohttp.ClientWebSocketResponse) -> None:
        await ws.send_bytes(b"\x00" * (MAX_FRAME * 4))

    run = await one_shot(http, stream_url(stack), headers=auth("alpha"), send=huge,
                         free=(stack, "alpha"))
    assert run.close_code == 1009


async def test_session_over_max_session_s_gets_its_finals_then_timeout(
    stack: Stack, http: aiohttp.ClientSession, one: tuple[bytes, int]
) -> None:
    pcm, rate = one
    long = pcm * 3  # 3 x ~3.6 s > max_session_s = 8

    async def send_all(ws: aiohttp.ClientWebSocketResponse) -> None:
        step = rate * 2 * FRAME_MS // 1000
        for offset in range(0, len(long), step):
            if ws.closed:
                return
            await ws.send_bytes(long[offset:offset + step])

    run = await one_shot(http, stream_url(stack), headers=auth("alpha"), send=send_all,
                         free=(stack, "alpha"))
    assert run.error["code"] == "timeout"
    assert "max_session_s" in run.error["message"]
    assert run.close_code == 1008
    assert run.of("final"), "the audio before the limit still gets its finals"
    assert run.events.index(run.of("final")[-1]) < run.events.index(run.error)


async def test_idle_stream_is_closed_with_timeout(
    stack: Stack, http: aiohttp.ClientSession, one: tuple[bytes, int]
) -> None:
    pcm, rate = one

    async def a_little(ws: aiohttp.ClientWebSocketResponse) -> None:
        await ws.send_bytes(pcm[: rate * 2])  # 1 s, then silence on the wire

    run = await one_shot(http, stream_url(stack), headers=auth("alpha"), send=a_little,
                         free=(stack, "alpha"))
    assert run.error["code"] == "timeout"
    assert "idle_timeout_s" in run.error["message"]
    assert run.close_code == 1008


# --- HTTP side ----------------------------------------------------------------------------


async def test_health_ready_metrics_and_json_errors(
    stack: Stack, http: aiohttp.ClientSession, one: tuple[bytes, int]
) -> None:
    await stream_speech(http, stack, *one, key="gamma", speed=0)  # something to measure
    assert get(stack.url + "/healthz")[:2] == (200, {"status": "ok"})
    status, body, _ = get(stack.url + "/readyz")
    assert status == 200
    assert isinstance(body, dict)
    assert body["realtime_workers"] == 1
    status, body, _ = get(stack.url + "/v1/stream")
    assert status == 426
    assert isinstance(body, dict)
    assert body["error"]["code"] == "bad_request"
    status, body, _ = get(stack.url + "/no/such/route")
    assert status == 404
    assert body == {"error": {"code": "not_found", "message": "Not Found"}}
    status, text, headers = get(stack.url + "/metrics")
    assert status == 200
    assert isinstance(text, str)
    assert headers["Content-Type"].startswith("text/plain")
    for name in ("lanegate_partial_latency_seconds_count", "lanegate_final_latency_seconds_count",
                 "lanegate_first_partial_seconds_count"):
        assert metric_value(text, name, lane="realtime") > 0, name
    assert metric_value(text, "lanegate_workers", lane="realtime") == 1


# --- workers dying and draining ---------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A gateway with two realtime workers of one slot each, failover off (with it on, a
    lost worker's stream moves to a free one: tests/test_failover.py)."""
    s = start_stack(tmp_path_factory.mktemp("pair-stack"), batch=False, realtime_slots=1,
                    # both sessions come anonymously from one address: no share limit
                    settings={"LANEGATE_DRAIN_TIMEOUT_S": "20", "LANEGATE_MAX_KEY_SHARE": "1",
                              "LANEGATE_FAILOVER_BUFFER_S": "0"})
    s.spawn("realtime-b", "worker", "--lane", "realtime")
    s.wait_workers(2)
    yield s
    s.stop()


async def _start_session(http: aiohttp.ClientSession, s: Stack, pcm: bytes
                         ) -> aiohttp.ClientWebSocketResponse:
    ws = await http.ws_connect(stream_url(s))
    assert json.loads((await ws.receive(timeout=EVENT_WAIT_S)).data)["type"] == "ready"
    await ws.send_bytes(pcm[: 16000 * 2])  # 1 s of speech
    return ws


async def _lost_after(ws: aiohttp.ClientWebSocketResponse, kill: Callable[[], None]
                      ) -> tuple[Run, float]:
    run = Run()
    kill()
    killed = time.monotonic()
    await collect(ws, run)
    return run, time.monotonic() - killed


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
async def test_worker_dying_mid_session_gives_worker_lost_and_the_gateway_carries_on(
    pair: Stack, http: aiohttp.ClientSession, one: tuple[bytes, int], how: str
) -> None:
    pair.ensure_workers("realtime", "realtime-b")
    pcm, rate = one
    ws = await _start_session(http, pair, pcm)
    (busy,) = pair.busy_workers()
    victim = pair.procs[busy].proc
    assert victim is not None
    # a session on the other worker, streaming while the first one's worker dies
    bystander = asyncio.create_task(stream_speech(http, pair, pcm, rate, key=None))
    try:
        for _ in range(100):
            if len(pair.busy_workers()) == 2:
                break
            await asyncio.sleep(0.05)
        run, waited = await _lost_after(
            ws, lambda: os.kill(victim.pid, getattr(signal, how)))
        await ws.close()
        assert run.error["code"] == "worker_lost"
        assert run.close_code == 1011
        # worker_lost_timeout_s = 2; the bound here only catches a missing detection
        assert waited < 2.0 + 1.0
        assert get(pair.url + "/healthz")[0] == 200
        other = await bystander
        assert other.events[-1] == {"type": "done"}, other.events
        assert recall(ONE, other.final_text) >= SENTENCE_RECALL
        after = await stream_speech(http, pair, pcm, rate, key=None, speed=0)
        assert after.events[-1] == {"type": "done"}
        assert recall(ONE, after.final_text) >= SENTENCE_RECALL
    finally:
        if victim.poll() is None:
            victim.send_signal(signal.SIGCONT)
            victim.kill()
            victim.wait(10)


async def test_worker_sigterm_drains_the_session_then_exits_0(
    pair: Stack, http: aiohttp.ClientSession, one: tuple[bytes, int]
) -> None:
    pair.ensure_workers("realtime", "realtime-b")
    pcm, rate = one
    ws = await _start_session(http, pair, pcm)
    (name,) = pair.busy_workers()
    victim = pair.procs[name].proc
    victim.send_signal(signal.SIGTERM)
    run = Run()
    receiver = asyncio.create_task(collect(ws, run))
    step = rate * 2 * FRAME_MS // 1000
    for offset in range(rate * 2, len(pcm), step):
        await ws.send_bytes(pcm[offset:offset + step])
        await asyncio.sleep(0.02)
    await ws.send_str('{"type":"end"}')
    await receiver
    assert run.events[-1] == {"type": "done"}, run.events
    assert run.close_code == 1000
    assert recall(ONE, run.final_text) >= SENTENCE_RECALL, run.final_text
    # drain_timeout_s is 20 here; the worker's server shutdown is bounded at 5 s more
    assert victim.wait(40) == 0
    # the other worker takes new sessions
    after = await stream_speech(http, pair, pcm, rate, key=None, speed=0)
    assert after.events[-1] == {"type": "done"}
