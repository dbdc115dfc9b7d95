"""What ``bench.load``'s WebSocket client costs per stream-second: ``--streams`` live
streams at real-time pace (100 ms frames, the load's) against ``bench.floor`` on
loopback, for ``--seconds`` each; the load process's CPU seconds over the
stream-seconds it sent (its start-up included, the same for any client).

    python -m bench.client_cost --streams 100 --seconds 20

It is how ``bench/wsclient.py`` chose aiohttp's client over its own frames (the figures
are in that module's docstring).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.load import RATE
from lanegate.supervisor import free_port, port_in_use


def wait_listening(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not port_in_use("127.0.0.1", port):
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench.floor is not listening on port {port}")
        time.sleep(0.1)


def measure(streams: int, seconds: float) -> dict[str, float]:
    port = free_port()
    floor = subprocess.Popen([sys.executable, "-m", "bench.floor", "--port", str(port)])
    try:
        wait_listening(port)
        with tempfile.TemporaryDirectory() as tmp:
            pcm = Path(tmp) / "silence.pcm"
            pcm.write_bytes(b"\x00\x00" * RATE * 10)
            spec = Path(tmp) / "spec.json"
            out = Path(tmp) / "out.json"
            spec.write_text(json.dumps({"t0_wall": time.time() + 2.0, "streams": [
                {"kind": "live", "url": f"ws://127.0.0.1:{port}/v1/stream",
                 "pcm_path": str(pcm), "start_s": i * 0.01, "duration_s": seconds}
                for i in range(streams)]}))
            subprocess.run([sys.executable, "-m", "bench.load", str(spec), str(out)],
                           check=True)
            result = json.loads(out.read_text())
    finally:
        floor.terminate()
        floor.wait(30)
    errors = sum(1 for r in result["results"] if r["error"])
    return {"streams": streams, "seconds": seconds, "errors": errors,
            "cpu_s": round(result["cpu_s"], 3),
            "cpu_ms_per_stream_s": round(1000 * result["cpu_s"] / (streams * seconds), 3)}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.client_cost")
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--seconds", type=float, default=20.0)
    a = p.parse_args()
    print(json.dumps(measure(a.streams, a.seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
