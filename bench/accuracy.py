"""The accuracy table: WER of each engine alone and through the service, on the same clips.

Alone: ``bench.raw_asr`` in a process pinned to the batch CPUs, each clip in one call.
Through the service: each condition's clips joined with pauses, streamed over
``/v1/stream`` at ``pace`` times real time (the realtime lane), and uploaded with
``POST /v1/transcriptions`` ``async=true`` (the batch lane).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import corpus
from bench.audio import write_wav
from bench.measure import job_texts, stream_url, submit, wait_jobs
from bench.stack import Stack
from bench.wer import corpus_wer

FRAME_MS = 100
GAP_S = 1.2  # silence after each clip in the joined audio: the VAD ends an utterance


def by_condition(clips: list[corpus.Clip]) -> dict[str, list[corpus.Clip]]:
    out: dict[str, list[corpus.Clip]] = {}
    for c in clips:
        out.setdefault(c.condition, []).append(c)
    return out


async def raw(engine: str, model: str, clips: list[corpus.Clip], cpus: str,
              work: Path) -> dict[str, Any]:
    """WER per condition of the engine alone (and its decode speed)."""
    tag = f"{engine}-{Path(model).name}"
    clips_path, out_path = work / f"raw-{tag}-clips.json", work / f"raw-{tag}.json"
    clips_path.write_text(json.dumps([str(c.path) for c in clips]))
    proc = await asyncio.create_subprocess_exec(
        "taskset", "-c", cpus, sys.executable, "-m", "bench.raw_asr", engine, model,
        str(clips_path), str(out_path))
    if await proc.wait() != 0:
        return {"error": f"raw_asr exit {proc.returncode}"}
    doc = json.loads(out_path.read_text())
    texts = dict(zip((str(c.path) for c in clips), doc["texts"], strict=True))
    out: dict[str, Any] = {"decode_s": doc["decode_s"], "audio_s": doc["audio_s"],
                           "wer": {}, "hyp": {}, "ref": {}}
    for cond, group in by_condition(clips).items():
        out["wer"][cond] = corpus_wer((c.text, texts[str(c.path)]) for c in group)
        out["hyp"][cond] = [texts[str(c.path)] for c in group]
        out["ref"][cond] = [c.text for c in group]
    out["wer"]["all"] = corpus_wer((c.text, texts[str(c.path)]) for c in clips)
    return out


async def stream_text(url: str, pcm: bytes, pace: float) -> tuple[str, str]:
    """The finals' text of one stream sent at ``pace`` x real time, and an error if any."""
    finals: list[str] = []
    error = ""
    step = 32 * FRAME_MS
    async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
        ready = await ws.receive_json(timeout=30)
        if ready.get("type") != "ready":
            return "", str(ready)

        async def send() -> None:
            start = time.perf_counter()
            for i, off in enumerate(range(0, len(pcm), step)):
                await asyncio.sleep(max(0.0, start + i * FRAME_MS / 1000 / pace
                                        - time.perf_counter()))
                await ws.send_bytes(pcm[off:off + step])
            await ws.send_str(json.dumps({"type": "end"}))

        sender = asyncio.create_task(send())
        async for msg in ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            event = json.loads(msg.data)
            if event.get("type") == "final":
                finals.append(str(event.get("text", "")))
            elif event.get("type") == "error":
                error = str(event.get("code"))
            elif event.get("type") == "done":
                break
        sender.cancel()
    return " ".join(finals), error


async def service(stack: Stack, clips: list[corpus.Clip], work: Path,
                  pace: float) -> dict[str, Any]:
    """WER per condition streamed (realtime lane) and uploaded (batch lane)."""
    groups = by_condition(clips)
    joined = {cond: corpus.joined(group, GAP_S, work, f"joined-{cond}")
              for cond, group in groups.items()}
    url = stream_url(stack.url)
    stream: dict[str, Any] = {"wer": {}, "hyp": {}, "errors": {},
                              "ref": {cond: ref for cond, (_, ref) in joined.items()}}
    pairs = []
    t0 = time.monotonic()
    for cond, (path, ref) in joined.items():
        text, error = await stream_text(url, path.read_bytes(), pace)
        stream["wer"][cond] = corpus_wer([(ref, text)])
        stream["hyp"][cond] = text
        if error:
            stream["errors"][cond] = error
        pairs.append((ref, text))
    stream["wer"]["all"] = corpus_wer(pairs)
    stream["wall_s"] = round(time.monotonic() - t0, 1)
    wavs = [write_wav(path.with_suffix(".wav"), path.read_bytes())
            for path, _ in joined.values()]
    t0 = time.monotonic()
    ids = await submit(stack, wavs)
    state = await wait_jobs(stack, ids, timeout_s=900)
    batch: dict[str, Any] = {"wer": {}, "hyp": {}, "statuses": [j["status"] for j in state]}
    pairs = []
    texts = await job_texts(stack, ids)
    for (cond, (_, ref)), text in zip(joined.items(), texts, strict=True):
        batch["wer"][cond] = corpus_wer([(ref, text)])
        batch["hyp"][cond] = text
        pairs.append((ref, text))
    batch["wer"]["all"] = corpus_wer(pairs)
    batch["wall_s"] = round(time.monotonic() - t0, 1)
    return {"stream": stream, "batch": batch}


