"""One data directory, one stack: ``lanegate up``'s lock on ``DATA_DIR/lanegate.lock``.

Two stacks on one data directory would run two ``redis-server``s appending to one
AOF (a rewrite by either loses the other's jobs) and two batch workers on one blob
store. So ``up`` holds an OS lock (``flock``) on that file from before it starts
anything until its last child is stopped: the supervisor holds it, and so does its
death watch (which inherits the descriptor and stops the children if the supervisor
is killed). The kernel lets go of it when they are gone, however they went. A second
``up`` on the directory is refused with one line naming the directory and the stack
that holds it.

The file is also the stack's pid file: one JSON object with the supervisor's pid,
its gateway and every child it started (name, stop order, pid and start time, as
the death watch is told), rewritten as children start and emptied at a clean stop.
An ``up`` that takes the lock reads what the stack before it left there. A child
still running (the same pid and start time: its supervisor and death watch were both
killed) is stopped in order, as the death watch would have stopped it, before
anything starts: never two Redis servers on one journal, no old gateway on the port.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from typing import Any

from lanegate.deathwatch import Watched, start_time

LOCK_FILE = "lanegate.lock"


class DataDirInUse(RuntimeError):
    """Another stack holds the data directory; the message says which."""


class StackLock:
    """The held lock on one data directory and the record of the stack holding it."""

    def __init__(self, fd: int, data_dir: str, gateway: str,
                 previous: dict[str, Any]) -> None:
        self.fd = fd
        self.data_dir = data_dir
        self._previous = previous
        self._record: dict[str, Any] = {"pid": os.getpid(), "gateway": gateway,
                                        "children": {}}
        self._write()

    @classmethod
    def take(cls, data_dir: str, gateway: str) -> StackLock:
        """The lock on ``data_dir`` (created if need be) for a stack serving ``gateway``;
        ``DataDirInUse`` if another stack holds it."""
        os.makedirs(data_dir, exist_ok=True)
        fd = os.open(os.path.join(data_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                     0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise DataDirInUse(in_use(data_dir, holder)) from None
        except OSError:
            os.close(fd)
            raise
        return cls(fd, data_dir, gateway, _read(fd))

    def leftovers(self) -> list[Watched]:
        """The previous stack's children that still run."""
        children = self._previous.get("children")
        if not isinstance(children, dict):
            return []
        found = []
        for name, child in children.items():
            with contextlib.suppress(KeyError, TypeError, ValueError):
                watched = Watched(str(name), int(child["order"]), int(child["pid"]),
                                  str(child["started"]))
                if watched.alive:
                    found.append(watched)
        return found

    def record(self, name: str, order: int, pid: int) -> None:
        """A child started (or restarted) under this name."""
        started = start_time(pid)
        if started is not None:
            self._record["children"][name] = {"order": order, "pid": pid, "started": started}
            self._write()

    def release(self) -> None:
        """A clean stop: no children left to record; the lock goes with the descriptor
        (a death watch still holding it lets go when it exits)."""
        if self.fd < 0:
            return
        self._record["children"] = {}
        self._write()
        os.close(self.fd)
        self.fd = -1

    def _write(self) -> None:
        data = json.dumps(self._record).encode() + b"\n"
        with contextlib.suppress(OSError):  # a full disk: the lock still holds
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)


def _read(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 1 << 20, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def in_use(data_dir: str, holder: dict[str, Any]) -> str:
    """The one line a second stack is refused with."""
    pid, gateway = holder.get("pid"), holder.get("gateway")
    if not isinstance(pid, int):
        who = "another lanegate up"
    elif start_time(pid) is None:  # the supervisor is gone; its death watch holds on
        return (f"data directory {data_dir} is in use: lanegate up (pid {pid}, gateway "
                f"{gateway}) died and its children are being stopped; try again in a "
                "moment")
    else:
        who = f"lanegate up (pid {pid}, gateway {gateway})"
    return (f"data directory {data_dir} is in use by {who}; stop it first, or give this "
            "one another --data-dir")
