"""Transparent failover of live streams, end to end: a real redis-server, the gateway
and two realtime workers (pocketsphinx) as subprocesses, real espeak-ng speech, a real
WebSocket client. The worker serving a stream is SIGKILLed or SIGSTOPped mid-sentence;
the client must get every final (the right words before and after the kill), no error,
no final twice and monotonic segments; with no free worker left, ``worker_lost``."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import read_pcm
from livestream import Seen, check_transcript, receive_all, send_speech, until
from phrases import MEETING, RAIN, SENTENCE_RECALL, TRAFFIC, recall, spoken
from stack import Stack, start_stack

WORKERS = ("realtime", "realtime-b")
SENTENCES = (TRAFFIC, RAIN, MEETING)
SPEECH = spoken(*SENTENCES)
#: A new worker's decoder starts where the replay starts, and pocketsphinx's text
#: depends on where its utterance starts (its live cepstral mean adapts from there).
#: Decoding SPEECH from 0 and from every 150 ms of the pause after TRAFFIC, in process:
#: TRAFFIC 0.91, RAIN 0.67-1.0, MEETING 0.62-0.88 (TALKING in RAIN's place measured
#: 0.25-0.5). The threshold stays 0.15 below the lowest.
FAILOVER_RECALL = 0.45
COMPLETED = "conversation.item.input_audio_transcription.completed"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two realtime workers of one slot each; a silent worker is lost after 1.5 s
    (``worker_lost_timeout_s`` 2: on this shared 2-core machine a worker digesting a
    replay while others run has missed a 0.75 s limit)."""
    # the victim and the bystander come anonymously from one address: no share limit;
    # a Realtime API session between its turns keeps its worker (no parking) until the
    # test has picked that worker as the victim
    s = start_stack(tmp_path_factory.mktemp("failover-stack"), batch=False,
                    realtime_slots=1, settings={"LANEGATE_MAX_KEY_SHARE": "1",
                                                "LANEGATE_REALTIME_PARK_AFTER_S": "60"})
    try:
        s.ensure_workers(*WORKERS)
        yield s
    finally:
        for child in s.procs.values():
            child.signal(signal.SIGCONT)
        s.stop()


@pytest.fixture(scope="module")
def three(speech: Callable[..., Path]) -> tuple[bytes, int]:
    return read_pcm(speech(SPEECH))


def stream_url(stack: Stack) -> str:
    return stack.url.replace("http://", "ws://") + "/v1/stream?sample_rate=16000"


def failovers(stack: Stack, outcome: str) -> float:
    with urllib.request.urlopen(stack.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    prefix = "lanegate_failovers_total{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix) and f'outcome="{outcome}"' in line)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
async def test_a_stream_survives_its_worker_dying_mid_sentence(
    pair: Stack, http: aiohttp.ClientSession, three: tuple[bytes, int], how: str
) -> None:
    pair.ensure_workers(*WORKERS)
    pcm, rate = three
    ok_before = failovers(pair, "ok")
    seen = Seen()
    async with http.ws_connect(stream_url(pair)) as ws:
        receiver = asyncio.create_task(receive_all(ws, seen))
        await until(lambda: bool(seen.events), "ready")
        # at real time, so that the kill finds the worker keeping up, as it does live
        sender = asyncio.create_task(send_speech(ws, pcm, rate, speed=1.0))
        # the first sentence is final and the second is being spoken: kill then
        await until(lambda: any(e.get("segment") == 1 for e in seen.of("partial")),
                    "a partial of the second sentence")
        (victim_name,) = pair.busy_workers()
        victim = pair.procs[victim_name].proc
        assert victim is not None
        finals_at_kill = len(seen.of("final"))
        os.kill(victim.pid, getattr(signal, how))
        killed = time.monotonic()
        try:
            await sender
            await receiver
        finally:
            if victim.poll() is None:
                victim.send_signal(signal.SIGCONT)
                victim.kill()
                victim.wait(10)
    print(f"\nfailover {how}: longest wait for an event after the kill "
          f"{seen.longest_gap_after(killed):.3f} s; finals before the kill {finals_at_kill}, "
          f"in all {len(seen.of('final'))}")
    check_transcript(seen, SENTENCES, FAILOVER_RECALL)
    assert finals_at_kill >= 1
    assert failovers(pair, "ok") == ok_before + 1


async def test_with_no_free_worker_the_client_gets_worker_lost_1011(
    pair: Stack, http: aiohttp.ClientSession, three: tuple[bytes, int]
) -> None:
    pair.ensure_workers(*WORKERS)
    pcm, rate = three
    no_worker_before = failovers(pair, "no_worker")
    victim_seen, bystander_seen = Seen(), Seen()
    async with http.ws_connect(stream_url(pair)) as victim_ws, \
            http.ws_connect(stream_url(pair)) as bystander_ws:
        tasks = [asyncio.create_task(receive_all(victim_ws, victim_seen)),
                 asyncio.create_task(receive_all(bystander_ws, bystander_seen))]
        await until(lambda: bool(victim_seen.events) and bool(bystander_seen.events),
                    "both ready")
        assert victim_seen.events[0][1]["type"] == "ready", victim_seen.events
        assert bystander_seen.events[0][1]["type"] == "ready", bystander_seen.events
        # both slots taken: the bystander's worker has none to spare
        await until(lambda: len(pair.busy_workers()) == 2, "both workers busy")
        bystander = asyncio.create_task(send_speech(bystander_ws, pcm, rate, speed=1.0))
        await victim_ws.send_bytes(pcm[:rate * 2])
        await until(lambda: bool(victim_seen.of("partial")), "a partial on the victim")
        name = victim_worker(pair, victim_seen)
        pair.procs[name].signal(signal.SIGKILL)
        await tasks[0]
        await bystander
        await tasks[1]
    assert victim_seen.of("error")[0]["code"] == "worker_lost", victim_seen.events
    assert victim_seen.close_code == 1011
    assert failovers(pair, "no_worker") == no_worker_before + 1
    bystander_kinds = [e["type"] for _, e in bystander_seen.events]
    assert "error" not in bystander_kinds, bystander_seen.events
    assert bystander_kinds[-1] == "done"
    assert recall(TRAFFIC, " ".join(f["text"] for f in bystander_seen.of("final"))) \
        >= SENTENCE_RECALL


def victim_worker(stack: Stack, seen: Seen) -> str:
    """The process name of the worker serving the session ``seen``: the one whose log
    started it (a worker that refused it, full, names it too)."""
    session_id = seen.events[0][1]["session_id"]
    for name in WORKERS:
        log = stack.procs[name].log
        if not log.exists():
            continue
        for line in log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict) and event.get("event") == "session_start" \
                        and event.get("session_id") == session_id:
                    return name
    raise AssertionError(f"no worker log started session {session_id}")


async def test_with_redis_down_the_failover_fails_cleanly_with_worker_lost(
    pair: Stack, http: aiohttp.ClientSession, three: tuple[bytes, int]
) -> None:
    pair.ensure_workers(*WORKERS)
    pcm, rate = three
    failed_before = failovers(pair, "failed")
    seen = Seen()
    async with http.ws_connect(stream_url(pair)) as ws:
        receiver = asyncio.create_task(receive_all(ws, seen))
        await until(lambda: bool(seen.events), "ready")
        await ws.send_bytes(pcm[:rate * 2])
        await until(lambda: bool(seen.of("partial")), "a partial")
        name = victim_worker(pair, seen)
        pair.redis.stop()  # no registry: no other worker can be found
        try:
            pair.procs[name].signal(signal.SIGKILL)
            await receiver
        finally:
            pair.redis.start()  # the same port and AOF
    assert seen.of("error")[0]["code"] == "worker_lost", seen.events
    assert seen.close_code == 1011
    assert failovers(pair, "failed") == failed_before + 1


# --- the OpenAI Realtime API: commits repeated in place --------------------------------
async def realtime_events(ws: aiohttp.ClientWebSocketResponse,
                          events: list[dict[str, Any]]) -> None:
    async for msg in ws:
        if msg.type is aiohttp.WSMsgType.TEXT:
            events.append(json.loads(msg.data))


def appends(pcm: bytes, rate: int, ms: int = 100) -> list[str]:
    step = rate * 2 * ms // 1000
    return [json.dumps({"type": "input_audio_buffer.append",
                        "audio": base64.b64encode(pcm[off:off + step]).decode()})
            for off in range(0, len(pcm), step)]


async def test_a_realtime_api_session_fails_over_and_its_pending_commit_is_repeated(
    pair: Stack, http: aiohttp.ClientSession, speech: Callable[..., Path]
) -> None:
    """Client commits (``turn_detection: null``): the worker is frozen right after the
    second commit, before its transcript; the session moves to the other worker, which
    hears the second turn again and the commit after it. Each item completes once."""
    pair.ensure_workers(*WORKERS)
    ok_before = failovers(pair, "ok")
    turns = []
    for sentence in (TRAFFIC, MEETING):
        pcm, rate = read_pcm(speech(sentence))
        turns.append(bytes(rate) + pcm + bytes(rate // 2))  # 0.5 s before, 0.25 s after
    url = pair.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    events: list[dict[str, Any]] = []
    async with http.ws_connect(url) as ws:
        reader = asyncio.create_task(realtime_events(ws, events))
        await until(lambda: bool(events), "session.created")
        await ws.send_str(json.dumps({"type": "session.update", "session": {
            "type": "transcription", "audio": {"input": {
                "format": {"type": "audio/pcm", "rate": rate}, "turn_detection": None}}}}))
        await until(lambda: any(e["type"] == "session.updated" for e in events), "updated")
        for message in appends(turns[0], rate):
            await ws.send_str(message)
            await asyncio.sleep(0.1)  # the first turn at real time
        await ws.send_str(json.dumps({"type": "input_audio_buffer.commit"}))
        await until(lambda: any(e["type"] == COMPLETED for e in events), "the first item")
        name = victim_worker_of(pair)
        for message in appends(turns[1], rate):  # the second at once: the worker is behind
            await ws.send_str(message)
        await ws.send_str(json.dumps({"type": "input_audio_buffer.commit"}))
        victim = pair.procs[name]
        victim.signal(signal.SIGSTOP)
        try:
            await until(lambda: len([e for e in events if e["type"] == COMPLETED]) == 2,
                        "the second item, from the other worker")
        finally:
            victim.signal(signal.SIGCONT)
        await ws.close()
        await reader
    kinds = [e["type"] for e in events]
    assert "error" not in kinds, events
    committed = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    completed = [e for e in events if e["type"] == COMPLETED]
    assert [c["item_id"] for c in committed] == [c["item_id"] for c in completed]
    assert recall(TRAFFIC, completed[0]["transcript"]) >= SENTENCE_RECALL
    assert recall(MEETING, completed[1]["transcript"]) >= FAILOVER_RECALL
    assert failovers(pair, "ok") == ok_before + 1


def victim_worker_of(stack: Stack) -> str:
    (name,) = stack.busy_workers()
    return name
