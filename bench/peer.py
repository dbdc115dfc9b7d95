"""WhisperLive as the benchmark's peer: its server in a venv of its own, pinned with
taskset, its faster_whisper backend on lanegate's model directory; a measuring window
of live streams (``bench.peer_load``) with optional long uploads to its REST endpoint.

Install notes: /work/shared/peers/whisperlive.md (``--peer-venv`` points at that venv).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.peer_load import PeerSpec
from bench.stats import summary
from bench.wer import corpus_wer

SERVER = """
from whisper_live.server import TranscriptionServer
TranscriptionServer().run("127.0.0.1", port={port}, backend="faster_whisper",
    faster_whisper_custom_model_path={model!r}, single_model=True, max_clients={clients},
    max_connection_time=3600, enable_rest=True, rest_port={rest_port},
    default_model={model!r})
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PeerServer:
    venv: Path
    model_dir: str
    cpus: str
    log: Path
    port: int = 0
    rest_port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    def argv(self, clients: int) -> list[str]:
        code = SERVER.format(port=self.port, model=self.model_dir, clients=clients,
                             rest_port=self.rest_port)
        return ["taskset", "-c", self.cpus, str(self.venv / "bin" / "python"), "-c", code]

    def describe(self) -> dict[str, Any]:
        return {"design": "whisperlive", "argv": [*self.argv(8)[:4], "-c", "<server code>"],
                "server_code": SERVER.strip(), "env": {"OMP_NUM_THREADS": "1",
                                                      "HF_HUB_OFFLINE": "1"},
                "cpus": self.cpus, "model": self.model_dir}


@contextlib.asynccontextmanager
async def running(server: PeerServer, clients: int = 8) -> AsyncIterator[PeerServer]:
    """The server up (its REST /health answering), stopped on exit."""
    server.port, server.rest_port = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    server.log.parent.mkdir(parents=True, exist_ok=True)
    server.proc = start(server.argv(clients), env, server.log)
    try:
        await wait_healthy(server, 120)
        yield server
    finally:
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(server.proc.wait, 10)
            except subprocess.TimeoutExpired:
                os.killpg(server.proc.pid, signal.SIGKILL)
                server.proc.wait(5)


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


async def wait_healthy(server: PeerServer, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            assert server.proc is not None
            if server.proc.poll() is not None:
                raise RuntimeError("WhisperLive exited:\n" + tail(server.log))
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(server.rest_url + "/health",
                                    timeout=aiohttp.ClientTimeout(2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"WhisperLive not healthy after {limit_s:.0f} s:\n" + tail(server.log))


def tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


async def upload(server: PeerServer, path: Path, timeout_s: float) -> dict[str, Any]:
    """One long recording to its OpenAI-style endpoint: wall time and text."""
    t0 = time.monotonic()
    form = aiohttp.FormData()
    body = await asyncio.to_thread(path.read_bytes)
    form.add_field("file", body, filename=path.name, content_type="audio/wav")
    form.add_field("language", "en")
    form.add_field("response_format", "text")
    try:
        async with aiohttp.ClientSession() as http, \
                http.post(server.rest_url + "/v1/audio/transcriptions", data=form,
                          timeout=aiohttp.ClientTimeout(timeout_s)) as r:
            text = await r.text()
            return {"status": r.status, "wall_s": round(time.monotonic() - t0, 1),
                    "words": len(text.split())}
    except (aiohttp.ClientError, TimeoutError) as exc:
        return {"status": None, "error": type(exc).__name__,
                "wall_s": round(time.monotonic() - t0, 1)}


async def window(server: PeerServer, name: str, clips: list[tuple[Path, str, float]],
                 uploads: list[Path], work: Path, tail_s: float) -> dict[str, Any]:
    """Live streams (one per clip), with ``uploads`` posted at the start beside them."""
    t0_wall = time.time() + 1.5
    specs = [PeerSpec(server.ws_url, str(p), server.model_dir, start_s=0.5 * i, tail_s=tail_s)
             for i, (p, _, _) in enumerate(clips)]
    spec_path, out_path = work / f"peer-{name}.json", work / f"peer-{name}.out.json"
    spec_path.write_text(json.dumps({"t0_wall": t0_wall, "streams": [asdict(s) for s in specs]}))
    out_path.unlink(missing_ok=True)
    longest = max(s for _, _, s in clips)
    posts = [asyncio.create_task(upload(server, p, timeout_s=longest + tail_s + 600))
             for p in uploads]
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.peer_load",
                                                str(spec_path), str(out_path))
    await asyncio.wait_for(proc.wait(), longest + tail_s + 120)
    if not out_path.exists():
        raise RuntimeError("bench.peer_load wrote nothing (it crashed)")
    results = json.loads(out_path.read_text())["results"]
    done_uploads = [t.result() for t in posts if t.done()]
    for t in posts:  # an upload still running when the streams end: not waited for
        t.cancel()
    out = summarize(results, [ref for _, ref, _ in clips])
    out["uploads"] = done_uploads
    out["uploads_unfinished_at_end"] = len(posts) - len(done_uploads)
    print(f"  [whisperlive/{name}] lag {out['partial_ms']} wer {out['live_wer']} "
          f"errors {out['errors']}", flush=True)
    return out


def summarize(results: list[dict[str, Any]], refs: list[str]) -> dict[str, Any]:
    errors: dict[str, int] = {}
    for r in results:
        if r["error"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    return {"live_streams": len(results),
            "partial_ms": summary([v for r in results for v in r["lag_ms"]]),
            "live_wer": corpus_wer(zip(refs, (r["text"] for r in results), strict=True)),
            "messages": sum(r["messages"] for r in results),
            "audio_s_sent": round(sum(r["audio_s_sent"] for r in results), 1),
            "errors": errors, "hyp": [r["text"] for r in results], "ref": refs}
