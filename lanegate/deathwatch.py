"""Stopping ``lanegate up``'s children in order when the supervisor itself dies.

A SIGKILLed supervisor runs no handler. With ``PR_SET_PDEATHSIG`` every child got
SIGTERM at the same instant, so Redis (which exits in a fraction of a second) was
gone before a batch worker could hand its job back (the job was charged an
attempt and waited ``claim_idle_s`` to be reclaimed) and the gateway's drain
waited on a dead Redis. Instead the supervisor starts this small process first
and tells it, through a pipe on its stdin, every child it starts::

    child <stop order> <pid> <start time> <name>
    done                       # a normal stop: every child is already stopped

End of file without ``done`` means the supervisor is gone: the children are
stopped exactly as ``Supervisor.stop_all`` would (by stop order: workers, the
gateway, Redis last; SIGTERM, SIGKILL after ``stop_timeout_s``), waiting for
each group to exit before the next. The start time (from ``/proc``) guards
against signalling a process that reused a dead child's pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO

from lanegate.logs import configure_logging, get_logger, guard_output

log = get_logger("lanegate.deathwatch")

POLL_S = 0.1


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None if it is gone or
    a zombie (``/proc/<pid>/stat`` field 22)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


@dataclass(frozen=True)
class Watched:
    name: str
    order: int
    pid: int
    started: str

    @property
    def alive(self) -> bool:
        return start_time(self.pid) == self.started

    def signal(self, sig: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


def read_children(lines: IO[str]) -> dict[str, Watched] | None:
    """The children announced until end of file, or None after ``done``."""
    children: dict[str, Watched] = {}
    for line in lines:
        parts = line.split(maxsplit=4)
        if parts == ["done"]:
            return None
        if len(parts) == 5 and parts[0] == "child":
            _, order, pid, started, name = parts
            children[name.strip()] = Watched(name.strip(), int(order), int(pid), started)
    return children


def stop_in_order(children: list[Watched], timeout_s: float) -> None:
    for order in sorted({c.order for c in children}):
        group = [c for c in children if c.order == order and c.alive]
        for child in group:
            log.info("orphan_stop", child=child.name, pid=child.pid)
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(c.alive for c in group) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        for child in group:
            if child.alive:
                log.warning("orphan_killed", child=child.name, after_s=timeout_s)
                child.signal(signal.SIGKILL)
            log.info("orphan_stopped", child=child.name)


class DeathWatch:
    """The supervisor's end: starts the watcher and announces children to it."""

    def __init__(self, stop_timeout_s: float, keep_fds: tuple[int, ...] = ()) -> None:
        """``keep_fds``: descriptors the watcher holds open until it exits (the data
        directory's lock: held until the last child is stopped)."""
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "lanegate.deathwatch", repr(stop_timeout_s)],
            stdin=subprocess.PIPE, text=True, start_new_session=True, pass_fds=keep_fds)

    def announce(self, name: str, order: int, pid: int) -> None:
        started = start_time(pid)
        if started is None or self._proc.stdin is None:
            return
        with contextlib.suppress(BrokenPipeError):
            self._proc.stdin.write(f"child {order} {pid} {started} {name}\n")
            self._proc.stdin.flush()

    def close(self, *, stopped: bool) -> None:
        """``stopped``: the children were stopped, the watcher just exits; else it
        stops them in order (the supervisor is failing)."""
        stdin, self._proc.stdin = self._proc.stdin, None
        if stdin is None:
            return
        with contextlib.suppress(BrokenPipeError):
            if stopped:
                stdin.write("done\n")
            stdin.close()
        if stopped:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the supervisor
    guard_output()  # its stderr is the supervisor's: the log reader may be gone
    configure_logging(os.environ.get("LANEGATE_LOG_LEVEL", "info"), process="deathwatch")
    children = read_children(sys.stdin)
    if children is None:
        return 0
    log.warning("supervisor_gone", children=sorted(children))
    stop_in_order(list(children.values()), float(argv[0]) if argv else 15.0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
