"""The gateway's links to its workers (``gateway/links.py``), end to end: real
redis-server, the gateway and a simulated realtime worker as subprocesses, real
espeak-ng speech, real aiohttp WebSocket clients on ``/v1/stream``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from conftest import read_pcm
from phrases import TRAFFIC
from stack import Stack, start_stack
from test_gateway_stream import EVENT_WAIT_S, FRAME_MS, collect, get, metric_value, stream_url
from wsrun import Run

from gateway.links import Inbox

SLOTS = 8
STREAMS = 6
#: the gateway's default worker_lost_timeout_s
LOST_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("links-stack"), batch=False, realtime_slots=SLOTS,
                    # every stream comes anonymously from one address: no share limit
                    settings={"LANEGATE_ENGINE": "simulated", "LANEGATE_MAX_KEY_SHARE": "1"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def pcm(speech: Callable[..., Path]) -> bytes:
    return read_pcm(speech(TRAFFIC))[0]


def links(stack: Stack) -> float:
    text = get(stack.url + "/metrics")[1]
    assert isinstance(text, str)
    return metric_value(text, "lanegate_gateway_worker_links", lane="realtime")


def slots_free(stack: Stack) -> int:
    """The realtime worker's free slots, from its own /readyz (via the registry's url)."""
    status, body, _ = get(stack.url + "/readyz")
    assert status == 200, body
    log = stack.procs["realtime"].log.read_text()
    url = next(json.loads(line)["url"] for line in log.splitlines()
               if line.startswith("{") and '"worker_started"' in line)
    ready = get(url + "/readyz")[1]
    assert isinstance(ready, dict), ready
    return int(ready["slots_free"])


async def ensure_worker(stack: Stack) -> None:
    """A live realtime worker (a test before may have killed it) the gateway can use."""
    proc = stack.procs["realtime"].proc
    if proc.poll() is None:
        return
    stack.procs["realtime"].log.unlink()
    stack.spawn("realtime", "worker", "--lane", "realtime")
    for _ in range(400):
        if stack.procs["realtime"].log.exists() and "worker_started" in \
                stack.procs["realtime"].log.read_text():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(stack.diagnostics())


async def hold(http: aiohttp.ClientSession, stack: Stack, pcm: bytes
               ) -> tuple[aiohttp.ClientWebSocketResponse, Run, asyncio.Task[None]]:
    """A stream that has its ``ready`` and one second of speech sent, still open."""
    ws = await http.ws_connect(stream_url(stack))
    run = Run()
    first = json.loads((await ws.receive(timeout=EVENT_WAIT_S)).data)
    assert first["type"] == "ready", first
    run.events.append(first)
    step = 16000 * 2 * FRAME_MS // 1000
    for offset in range(0, 16000 * 2, step):
        await ws.send_bytes(pcm[offset:offset + step])
    return ws, run, asyncio.create_task(collect(ws, run))


async def test_concurrent_streams_share_one_link_to_their_worker(
    stack: Stack, http: aiohttp.ClientSession, pcm: bytes
) -> None:
    await ensure_worker(stack)
    held = await asyncio.gather(*[hold(http, stack, pcm) for _ in range(STREAMS)])
    try:
        for _ in range(100):
            if slots_free(stack) == SLOTS - STREAMS:
                break
            await asyncio.sleep(0.05)
        assert slots_free(stack) == SLOTS - STREAMS
        assert links(stack) == 1
        for ws, _, _ in held:
            await ws.send_str('{"type":"end"}')
        for _, run, receiver in held:
            await asyncio.wait_for(receiver, EVENT_WAIT_S)
            assert run.events[-1] == {"type": "done"}, run.events
            assert run.close_code == 1000
            assert run.of("partial"), "partials come back over the shared link"
    finally:
        for ws, _, _ in held:
            await ws.close()
    for _ in range(100):
        if slots_free(stack) == SLOTS:
            break
        await asyncio.sleep(0.05)
    assert slots_free(stack) == SLOTS
    assert links(stack) == 1, "a link with no sessions stays open"


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
async def test_a_dead_worker_gives_every_stream_on_its_link_worker_lost(
    stack: Stack, http: aiohttp.ClientSession, pcm: bytes, how: str
) -> None:
    await ensure_worker(stack)
    victim = stack.procs["realtime"].proc
    held = await asyncio.gather(*[hold(http, stack, pcm) for _ in range(STREAMS)])
    try:
        assert links(stack) == 1
        os.kill(victim.pid, getattr(signal, how))
        killed = time.monotonic()
        for ws, run, receiver in held:
            await asyncio.wait_for(receiver, EVENT_WAIT_S)
            waited = time.monotonic() - killed
            assert run.error["code"] == "worker_lost", run.events
            assert run.close_code == 1011
            assert waited < LOST_TIMEOUT_S + 1.0, waited  # catches a missing detection
            await ws.close()
        assert links(stack) == 0, "a lost link leaves the gateway's map"
    finally:
        for ws, _, _ in held:
            await ws.close()
        if victim.poll() is None:
            victim.send_signal(signal.SIGCONT)
            victim.kill()
        victim.wait(10)
    await ensure_worker(stack)
    ws, run, receiver = await hold(http, stack, pcm)
    await ws.send_str('{"type":"end"}')
    await asyncio.wait_for(receiver, EVENT_WAIT_S)
    assert run.events[-1] == {"type": "done"}, run.events
    assert links(stack) == 1, "the next session opened a new link"


async def test_a_channel_inbox_keeps_order_and_survives_a_reader_that_timed_out() -> None:
    """A session's opening waits for the worker's answer with a timeout, then its relay
    reads the same inbox: a read given up leaves no stale reader behind, and events put
    while nobody reads come out in order."""
    inbox = Inbox()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await inbox.get()
    reader = asyncio.create_task(inbox.get())
    await asyncio.sleep(0)
    inbox.put_nowait({"type": "accepted"})
    assert await asyncio.wait_for(reader, 1) == {"type": "accepted"}
    for n in range(3):
        inbox.put_nowait({"type": "partial", "segment": n})
    assert inbox.qsize() == 3
    assert [await inbox.get() for _ in range(3)] == [
        {"type": "partial", "segment": n} for n in range(3)]
    first = asyncio.create_task(inbox.get())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="one reader"):
        await inbox.get()
    first.cancel()
