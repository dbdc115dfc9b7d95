"""Which network addresses a server-side request may go to: a pure policy.

Webhook URLs come from clients, so a worker that POSTs to one must not become a
way into the private network (the metadata service at 169.254.169.254, Redis,
the internal worker API, anything on loopback). The policy is decided on
*resolved addresses*, never on the URL's spelling, and every spelling of an
address is first brought to one ``ipaddress`` object:

* IPv4 in the forms ``inet_aton`` accepts: ``2130706433``, ``0x7f.1``,
  ``0177.0.0.1``, ``127.1`` (all 127.0.0.1);
* IPv6 in brackets or not, with a zone (``fe80::1%eth0``);
* IPv4 inside IPv6: mapped ``::ffff:a.b.c.d``, compatible ``::a.b.c.d``, 6to4
  ``2002:AABB:CCDD::/48``, NAT64 ``64:ff9b::/96`` and ``64:ff9b:1::/48``, Teredo
  (server and client): such an address is as forbidden as the IPv4 it carries;
* trailing-dot names (``localhost.``) and the ``localhost`` names of RFC 6761,
  which are loopback whatever DNS says.

Nothing here does I/O; ``lanegate/webhooks.py`` resolves names and applies it.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: networks of one site: RFC 1918, carrier-grade NAT (RFC 6598), IPv6 unique and
#: site local
_PRIVATE_NETS = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7", "fec0::/10"))
_MAPPED_ZERO = ipaddress.ip_network("::ffff:0:0:0/96")  # IPv4-translated (RFC 2765)
_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated IPv4-compatible
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_LOCALHOST_NAMES = ("localhost", "localhost.localdomain")
_HEX = re.compile(r"0[xX][0-9a-fA-F]*")
_OCTAL = re.compile(r"0[0-7]*")
_DECIMAL = re.compile(r"[1-9][0-9]*")


class AddressClass(enum.Enum):
    """What an address reaches; every class but ``PUBLIC`` is refused by default."""

    PUBLIC = "public"
    LOOPBACK = "loopback"
    PRIVATE = "private"
    LINK_LOCAL = "link-local"
    MULTICAST = "multicast"
    RESERVED = "reserved"
    UNSPECIFIED = "unspecified"


#: most dangerous first: of the IPv4 addresses an IPv6 one carries, the first wins
_STRICTNESS = [AddressClass.UNSPECIFIED, AddressClass.LOOPBACK, AddressClass.LINK_LOCAL,
               AddressClass.MULTICAST, AddressClass.RESERVED, AddressClass.PRIVATE,
               AddressClass.PUBLIC]

#: the classes ``webhook_allow_private`` lets through (tests, internal receivers);
#: link-local (cloud metadata), multicast, reserved and unspecified never are
PRIVATE_CLASSES = frozenset({AddressClass.LOOPBACK, AddressClass.PRIVATE})


@dataclass(frozen=True)
class Refusal:
    """An address the policy refuses, and why."""

    address: IPAddress
    kind: AddressClass

    def __str__(self) -> str:
        return f"{self.address} is {self.kind.value}"


def parse_ipv4(text: str) -> ipaddress.IPv4Address | None:
    """An IPv4 address in any form ``inet_aton`` reads (1-4 parts, each decimal,
    0-octal or 0x-hex; the last part fills the remaining bytes), else None."""
    parts = text.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    numbers = [_number(p) for p in parts]
    if any(n is None for n in numbers):
        return None
    values = [n for n in numbers if n is not None]
    *head, last = values
    if any(v > 0xFF for v in head) or last >= 1 << (8 * (5 - len(values))):
        return None
    total = 0
    for v in head:
        total = total << 8 | v
    return ipaddress.IPv4Address(total << (8 * (5 - len(values))) | last)


def _number(part: str) -> int | None:
    if _HEX.fullmatch(part):
        return int(part[2:] or "0", 16)
    if _OCTAL.fullmatch(part):
        return int(part, 8)
    if _DECIMAL.fullmatch(part):
        return int(part, 10)
    return None


def parse_ip(host: str) -> IPAddress | None:
    """The address a URL host names literally, in any spelling; None for a name."""
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if ":" in text:
        try:
            return ipaddress.IPv6Address(text.split("%", 1)[0])
        except ValueError:
            return None
    return parse_ipv4(text[:-1] if text.endswith(".") else text)


def is_localhost_name(host: str) -> bool:
    """``localhost`` and its subdomains (RFC 6761), with or without the trailing dot."""
    name = host.strip().rstrip(".").lower()
    return name in _LOCALHOST_NAMES or name.endswith(".localhost")


def embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (mapped, compatible, 6to4, NAT64,
    Teredo), which is where a packet to it may end up."""
    found: list[ipaddress.IPv4Address] = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        found.extend(address.teredo)
    translated = address in _MAPPED_ZERO or any(address in net for net in _NAT64)
    compatible = address in _COMPATIBLE and int(address) > 1  # not :: or ::1
    if translated or compatible:
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF))
    return found


def classify(address: IPAddress) -> AddressClass:
    """The class of one address. An IPv6 address that carries IPv4 ones is judged
    by what it carries (the strictest class of them), since that is where a packet
    to it ends up."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = embedded_ipv4(address)
        if inner:
            return min((_own_class(a) for a in inner), key=_STRICTNESS.index)
    return _own_class(address)


def _own_class(address: IPAddress) -> AddressClass:
    if address.is_unspecified:
        return AddressClass.UNSPECIFIED
    if address.is_loopback:
        return AddressClass.LOOPBACK
    if address.is_link_local:
        return AddressClass.LINK_LOCAL
    if address.is_multicast:
        return AddressClass.MULTICAST
    if any(address in net for net in _PRIVATE_NETS):
        return AddressClass.PRIVATE
    if address.is_reserved or not address.is_global:
        return AddressClass.RESERVED  # broadcast, 240/4, documentation, benchmarking, ...
    return AddressClass.PUBLIC


def refusals(addresses: Iterable[IPAddress], *, allow_private: bool = False) -> list[Refusal]:
    """The addresses of ``addresses`` the policy refuses (empty: all may be used)."""
    out = []
    for address in addresses:
        kind = classify(address)
        if kind is AddressClass.PUBLIC or (allow_private and kind in PRIVATE_CLASSES):
            continue
        out.append(Refusal(address, kind))
    return out


def is_loopback_host(host: str) -> bool:
    """Whether a bind address reaches only this machine (``127.0.0.0/8``, ``::1``,
    ``localhost``); ``0.0.0.0``, ``::``, an empty host or any other name do not."""
    if is_localhost_name(host):
        return True
    address = parse_ip(host)
    return address is not None and address.is_loopback
