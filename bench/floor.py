"""The floor under the gateway's CPU: a bare aiohttp WebSocket server on the same event
loop that only receives the load's audio frames and sends events at the gateway's rate,
relaying nothing, parsing nothing beyond the frames, keeping no state but a counter.

    python -m bench.floor --port PORT

It speaks just enough of ``/v1/stream`` for ``bench.load``: ``ready`` first, a
``partial`` every ``PARTIAL_EVERY_FRAMES`` audio frames and a ``final`` every
``FINAL_EVERY_FRAMES`` (2.2 events per stream-second at 100 ms frames: the rate the
gateway sends with partials only on change), ``done`` after ``end``; with ``--quiet``
only ``ready`` and ``done`` (what the frames cost alone). Scenario 5 measures
it in the same rounds as the gateway: what the gateway costs per stream-second beyond
this is the relay itself (the link, the timeline, the replay buffer, the events' mapping).
"""

from __future__ import annotations

import argparse
import json

from aiohttp import WSMsgType, web

from bench.load import BYTES_PER_MS
from lanegate.loops import new_loop

PARTIAL_EVERY_FRAMES = 5
FINAL_EVERY_FRAMES = 50
QUIET = web.AppKey("quiet", bool)


def event(kind: str, audio_ms: int) -> str:
    text = "the quick brown fox jumps over the lazy dog"
    return json.dumps({"type": kind, "segment": audio_ms // 5000, "text": text,
                       "audio_end_ms": audio_ms}, separators=(",", ":"))


async def stream(request: web.Request) -> web.WebSocketResponse:
    quiet = request.app[QUIET]
    ws = web.WebSocketResponse(max_msg_size=1 << 22)
    await ws.prepare(request)
    await ws.send_str(json.dumps({"type": "ready", "lane": "floor"}))
    frames = audio_ms = 0
    async for msg in ws:
        if msg.type is WSMsgType.BINARY:
            frames += 1
            audio_ms += len(msg.data) // BYTES_PER_MS
            if quiet:
                continue
            if frames % FINAL_EVERY_FRAMES == 0:
                await ws.send_str(event("final", audio_ms))
            elif frames % PARTIAL_EVERY_FRAMES == 0:
                await ws.send_str(event("partial", audio_ms))
        elif msg.type is WSMsgType.TEXT:  # ``end``: the only control the load sends
            await ws.send_str(json.dumps({"type": "done"}))
            break
    await ws.close()
    return ws


def make_app(*, quiet: bool = False) -> web.Application:
    """``quiet``: no partials or finals (the frames' cost alone)."""
    app = web.Application()
    app[QUIET] = quiet
    app.router.add_get("/v1/stream", stream)
    return app


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.floor")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--quiet", action="store_true", help="send no partials or finals")
    a = p.parse_args()
    # the gateway's loop (setting event_loop, default uvloop)
    web.run_app(make_app(quiet=a.quiet), host="127.0.0.1", port=a.port, print=None, access_log=None,
                loop=new_loop("uvloop"))


if __name__ == "__main__":
    main()
