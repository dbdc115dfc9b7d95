"""How fast the machine is at a given moment: a fixed-loop probe, CPU steal, perf counters.

The VM's speed wanders (the same loop took 0.38 to 1.07 s within minutes), so
every round records the probe before and after it and the hypervisor's steal
over it, and the report shows them beside the round's figures.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

#: iterations of the fixed pure-Python loop (about 0.4 s on an idle core of the bench VM)
PROBE_LOOP = 3_000_000
CLK_TCK = os.sysconf("SC_CLK_TCK")
#: /proc/stat cpu columns: user nice system idle iowait irq softirq steal
STEAL, IDLE, IOWAIT = 7, 3, 4


def probe_loop_s(n: int = PROBE_LOOP) -> float:
    """Seconds a fixed interpreter loop takes now: the machine's speed, higher = slower."""
    t0 = time.perf_counter()
    s = 0
    for i in range(n):
        s += i * i
    return round(time.perf_counter() - t0, 4)


def parse_proc_stat(text: str) -> dict[str, list[int]]:
    """The cpu lines of /proc/stat (``cpu`` is all CPUs together): their first 8 columns."""
    out = {}
    for line in text.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu"):
            out[name] = [int(f) for f in fields[:8]] + [0] * (8 - len(fields[:8]))
    return out


def proc_stat() -> dict[str, list[int]]:
    return parse_proc_stat(Path("/proc/stat").read_text())


def steal(before: dict[str, list[int]], after: dict[str, list[int]],
          cpu: str = "cpu") -> dict[str, float]:
    """CPU time the hypervisor gave to others between two reads (``cpu``: all CPUs):
    seconds, and as a share of the time elapsed on those CPUs; and the busy share."""
    d = [a - b for a, b in zip(after[cpu], before[cpu], strict=True)]
    total = sum(d)
    if total <= 0:
        return {"steal_s": 0.0, "steal_share": 0.0, "busy_share": 0.0}
    return {"steal_s": round(d[STEAL] / CLK_TCK, 2),
            "steal_share": round(d[STEAL] / total, 4),
            "busy_share": round((total - d[IDLE] - d[IOWAIT]) / total, 4)}


class Moment:
    """What the machine was like over a stretch of the run: ``end()`` returns the probe
    before and after, the steal and the busy share over it, and its wall time."""

    def __init__(self) -> None:
        self.probe_before = probe_loop_s()
        self.stat = proc_stat()
        self.t0 = time.monotonic()

    def end(self) -> dict[str, Any]:
        stat = proc_stat()
        wall = time.monotonic() - self.t0
        return {"probe_s": [self.probe_before, probe_loop_s()], **steal(self.stat, stat),
                "wall_s": round(wall, 1)}


# --- perf stat -----------------------------------------------------------------------


def parse_perf_csv(text: str, event: str = "instructions") -> int | None:
    """The count of ``event`` in ``perf stat -x,`` output; None when not counted."""
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) >= 3 and fields[2].split(":")[0] == event:
            try:
                return int(fields[0])
            except ValueError:  # "<not supported>" or "<not counted>"
                return None
    return None


def perf_support() -> dict[str, Any]:
    """Whether ``perf stat`` counts instructions here, and if not, why."""
    perf = shutil.which("perf")
    if perf is None:
        return {"supported": False, "reason": "perf is not installed (apt-get install "
                "linux-perf)"}
    try:
        run = subprocess.run([perf, "stat", "-x,", "-e", "instructions", "true"],
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"supported": False, "reason": f"perf stat failed: {exc}"}
    if parse_perf_csv(run.stderr) is not None:
        return {"supported": True, "reason": ""}
    devices = sorted(p.name for p in Path("/sys/bus/event_source/devices").glob("*"))
    why = ("the kernel has no hardware PMU (no `cpu` in /sys/bus/event_source/devices: "
           f"{', '.join(devices)}); the hypervisor does not expose the CPU's counters"
           if "cpu" not in devices else "perf stat -e instructions reports: "
           + (run.stderr.strip().splitlines() or ["nothing"])[-1])
    return {"supported": False, "reason": why}


class PerfCounter:
    """``perf stat -e instructions -p PID`` from construction to ``stop()``."""

    def __init__(self, pid: int) -> None:
        self.proc = subprocess.Popen(["perf", "stat", "-x,", "-e", "instructions",
                                      "-p", str(pid)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)

    def stop(self) -> int | None:
        self.proc.send_signal(2)  # SIGINT: perf prints its counts and exits
        try:
            _, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return None
        return parse_perf_csv(err)
