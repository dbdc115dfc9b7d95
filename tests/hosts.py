"""Several hosts on one machine: network namespaces joined by veth pairs to a bridge.

Every namespace (host) gets one veth end, an address on a private /24 and ``lo``;
the other ends sit on a bridge in a namespace of its own, so the root namespace
has no interface on that network and traffic stays between the hosts. Processes
run inside their host with ``ip netns exec``; the test's own client code runs in a
thread that ``setns``-es into the client host (``Hosts.run_as``), so its sockets
live there too. ``Hosts.close`` deletes every namespace (their veths go with
them) and is safe to call after a partial setup.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"


class Unavailable(Exception):
    """Namespaces cannot be built here: the reason, for a skip."""


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(("netns", "exec", ns, "ip") if ns else ()), *args]
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=10)


def why_unavailable() -> str | None:
    """None when this process can build namespaces, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    probe = f"lgprobe{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"`ip netns add` fails: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def remove_stale() -> None:
    """Delete the namespaces of an earlier run whose process is gone (one killed before
    its finalizer ran): names ``lg{pid}-...``."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    for line in listing.stdout.splitlines():
        match = re.match(r"(lg(\d+)-\S+)", line)
        if match and not os.path.exists(f"/proc/{match.group(2)}"):
            subprocess.run(["ip", "netns", "del", match.group(1)], capture_output=True)


def in_probe_namespace(argv: list[str], stdin: str | None = None
                       ) -> subprocess.CompletedProcess[str]:
    """``argv`` run in a namespace of its own, deleted after: does it work here?"""
    probe = f"lgprobe{os.getpid()}-{argv[0]}"
    subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True)
    try:
        return subprocess.run(["ip", "netns", "exec", probe, *argv], input=stdin,
                              capture_output=True, text=True)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def netem_problem() -> str | None:
    """None when ``tc qdisc ... netem`` works in a namespace here, else why not."""
    if shutil.which("tc") is None:
        return "no `tc` (iproute2)"
    result = in_probe_namespace(["tc", "qdisc", "add", "dev", "lo", "root", "netem",
                                 "delay", "10ms"])
    if result.returncode != 0:
        return (f"`tc qdisc add ... netem` fails here ({result.stderr.strip()}): this "
                "kernel has no sch_netem and modules cannot be loaded")
    return None


def nft_problem() -> str | None:
    """None when nftables (``nft``, with ``numgen``) can drop packets in a namespace."""
    if shutil.which("nft") is None:
        return "no `nft` (Debian's nftables)"
    result = in_probe_namespace(["nft", "-f", "-"], stdin=nft_loss_rules(5))
    if result.returncode != 0:
        return f"nftables cannot drop packets here ({result.stderr.strip()})"
    return None


def nft_loss_rules(percent: int) -> str:
    """An nftables table that drops ``percent`` % of a host's packets at random, in and out:
    the loss half of ``netem loss``, for kernels without sch_netem."""
    return (f"table inet lgloss {{\n"
            f"  chain in {{ type filter hook input priority 0; "
            f"numgen random mod 100 < {percent} drop; }}\n"
            f"  chain out {{ type filter hook output priority 0; "
            f"numgen random mod 100 < {percent} drop; }}\n}}\n")


@dataclass
class Hosts:
    """Namespaces ``{prefix}-{name}`` on 10.{net}.0.0/24, built by ``add``."""

    prefix: str
    net: int
    addresses: dict[str, str] = field(default_factory=dict)
    _made: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def dev(self, host: str) -> str:
        """The host's interface (its switch side is ``dev + 'p'``)."""
        return f"{self.prefix}{list(self.addresses).index(host)}"

    def start(self) -> None:
        self._netns("add", self.switch)
        ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        ip("link", "set", "br0", "up", ns=self.switch)

    def add(self, host: str) -> str:
        """A new host with the next address; returns the address."""
        address = f"10.{self.net}.0.{len(self.addresses) + 2}"
        self.addresses[host] = address
        name, dev = self.ns(host), self.dev(host)
        self._netns("add", name)
        ip("link", "add", dev, "type", "veth", "peer", "name", dev + "p")
        ip("link", "set", dev, "netns", name)
        ip("link", "set", dev + "p", "netns", self.switch)
        ip("link", "set", dev + "p", "master", "br0", ns=self.switch)
        ip("link", "set", dev + "p", "up", ns=self.switch)
        ip("addr", "add", f"{address}/24", "dev", dev, ns=name)
        ip("link", "set", dev, "up", ns=name)
        ip("link", "set", "lo", "up", ns=name)
        return address

    def _netns(self, verb: str, name: str) -> None:
        subprocess.run(["ip", "netns", verb, name], check=True, capture_output=True,
                       text=True, timeout=10)
        self._made.append(name)

    def link(self, host: str, up: bool) -> None:
        """Cut (or restore) the host's link: its veth end goes down (or up)."""
        ip("link", "set", self.dev(host), "up" if up else "down", ns=self.ns(host))

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def run_as(self, host: str, fn: Callable[[], T]) -> T:
        """``fn()`` in a thread inside the host's namespace; its result or its error."""
        out: dict[str, Any] = {}

        def target() -> None:
            try:
                _setns(os.path.join(NETNS_DIR, self.ns(host)))
                out["value"] = fn()
            except BaseException as exc:  # re-raised in the caller
                out["error"] = exc

        thread = threading.Thread(target=target, name=f"in-{host}")
        thread.start()
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["value"]  # type: ignore[no-any-return]

    def close(self) -> None:
        """Delete every namespace made (their veths and the bridge go with them)."""
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        self._made.clear()
        for host in self.addresses:  # a veth left in the root namespace by a failed add
            ip("link", "del", self.dev(host), check=False)


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {path}: {os.strerror(err)}")
    finally:
        os.close(fd)
