"""lanegate/addresses.py: the address policy of webhooks, as a pure function over
addresses in every spelling. Nothing here opens a socket: the classes a test must
never send traffic to are checked by the filter itself."""

from __future__ import annotations

import ipaddress

import pytest

from lanegate.addresses import (
    AddressClass,
    classify,
    is_localhost_name,
    is_loopback_host,
    parse_ip,
    parse_ipv4,
    refusals,
)

LOOPBACK, PRIVATE, LINK_LOCAL = AddressClass.LOOPBACK, AddressClass.PRIVATE, AddressClass.LINK_LOCAL
MULTICAST, RESERVED = AddressClass.MULTICAST, AddressClass.RESERVED
UNSPECIFIED, PUBLIC = AddressClass.UNSPECIFIED, AddressClass.PUBLIC


@pytest.mark.parametrize(("spelling", "address"), [
    ("127.0.0.1", "127.0.0.1"),
    ("2130706433", "127.0.0.1"),        # one decimal number
    ("0x7f000001", "127.0.0.1"),        # one hex number
    ("017700000001", "127.0.0.1"),      # one octal number
    ("0177.0.0.1", "127.0.0.1"),        # octal part
    ("0x7f.0.0.1", "127.0.0.1"),        # hex part
    ("0x7f.1", "127.0.0.1"),            # two parts: the last fills three bytes
    ("127.1", "127.0.0.1"),
    ("127.0.1", "127.0.0.1"),           # three parts: the last fills two bytes
    ("0XA9.0376.43518", "169.254.169.254"),
    ("0", "0.0.0.0"),
    ("127.0.0.1.", "127.0.0.1"),        # trailing dot
    ("[::1]", "::1"),
    ("::ffff:127.0.0.1", "::ffff:7f00:1"),
    ("[::ffff:7f00:1]", "::ffff:7f00:1"),
    ("fe80::1%eth0", "fe80::1"),
])
def test_every_spelling_becomes_one_address(spelling: str, address: str) -> None:
    parsed = parse_ip(spelling)
    assert parsed is not None
    assert parsed.compressed == ipaddress.ip_address(address).compressed


@pytest.mark.parametrize("name", [
    "example.com", "256.0.0.1", "1.2.3.4.5", "08.1", "0x1g", "1.16777216", "1..2",
    "", "١٢٧.0.0.1", "1_0.0.0.1", "0x_7f.1", "[::1", "::g",
])
def test_names_and_bad_numbers_are_not_addresses(name: str) -> None:
    assert parse_ip(name) is None


def test_ipv4_parts_cover_the_whole_range() -> None:
    assert parse_ipv4("1.16777215") == ipaddress.IPv4Address("1.255.255.255")
    assert parse_ipv4("4294967295") == ipaddress.IPv4Address("255.255.255.255")
    assert parse_ipv4("4294967296") is None


@pytest.mark.parametrize(("host", "kind"), [
    ("127.0.0.1", LOOPBACK), ("127.255.255.254", LOOPBACK), ("::1", LOOPBACK),
    ("2130706433", LOOPBACK), ("0x7f.1", LOOPBACK), ("[::ffff:127.0.0.1]", LOOPBACK),
    ("::127.0.0.1", LOOPBACK),                     # IPv4-compatible
    ("::ffff:0:7f00:1", LOOPBACK),                 # IPv4-translated
    ("2002:7f00:1::", LOOPBACK),                   # 6to4 of 127.0.0.1
    ("64:ff9b::7f00:1", LOOPBACK),                 # NAT64 of 127.0.0.1
    ("10.0.0.1", PRIVATE), ("172.16.5.4", PRIVATE), ("172.31.255.255", PRIVATE),
    ("192.168.1.1", PRIVATE), ("100.64.0.1", PRIVATE), ("fc00::1", PRIVATE),
    ("fd12:3456::1", PRIVATE), ("64:ff9b:1::a00:1", PRIVATE), ("::ffff:10.0.0.1", PRIVATE),
    ("169.254.169.254", LINK_LOCAL), ("169.254.0.1", LINK_LOCAL), ("fe80::1", LINK_LOCAL),
    ("[::ffff:169.254.169.254]", LINK_LOCAL), ("2002:a9fe:a9fe::", LINK_LOCAL),
    ("0XA9.0376.43518", LINK_LOCAL),
    ("224.0.0.1", MULTICAST), ("239.255.255.250", MULTICAST), ("ff02::1", MULTICAST),
    ("0.0.0.0", UNSPECIFIED), ("0", UNSPECIFIED), ("::", UNSPECIFIED),
    ("::ffff:0.0.0.0", UNSPECIFIED),
    ("255.255.255.255", RESERVED), ("240.0.0.1", RESERVED), ("0.1.2.3", RESERVED),
    ("192.0.2.1", RESERVED), ("198.18.0.1", RESERVED), ("2001:db8::1", RESERVED),
    ("100::1", RESERVED), ("2001:0:4136:e378:8000:63bf:3fff:fdd2", RESERVED),  # Teredo
    ("8.8.8.8", PUBLIC), ("1.1.1.1", PUBLIC), ("16843009", PUBLIC), ("2606:4700::1111", PUBLIC),
    ("::ffff:8.8.8.8", PUBLIC), ("2002:808:808::", PUBLIC), ("64:ff9b::808:808", PUBLIC),
    ("172.32.0.1", PUBLIC), ("100.128.0.1", PUBLIC),
])
def test_classes(host: str, kind: AddressClass) -> None:
    address = parse_ip(host)
    assert address is not None
    assert classify(address) is kind


def _ips(*hosts: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    out = [parse_ip(h) for h in hosts]
    assert all(a is not None for a in out)
    return [a for a in out if a is not None]


def test_only_public_addresses_pass_by_default() -> None:
    assert refusals(_ips("8.8.8.8", "2606:4700::1111")) == []
    for host in ("127.0.0.1", "10.0.0.1", "169.254.169.254", "224.0.0.1", "0.0.0.0",
                 "240.0.0.1", "::1", "::ffff:127.0.0.1", "fc00::1"):
        (refusal,) = refusals(_ips(host))
        assert refusal.kind is not PUBLIC
        assert str(refusal).startswith(str(refusal.address))


def test_one_bad_address_among_good_ones_is_refused() -> None:
    # a name that resolves to a public and a private address must not pass
    (refusal,) = refusals(_ips("8.8.8.8", "10.1.2.3"))
    assert (str(refusal.address), refusal.kind) == ("10.1.2.3", PRIVATE)


def test_allow_private_lets_loopback_and_private_through_but_never_metadata() -> None:
    assert refusals(_ips("127.0.0.1", "::1", "10.0.0.1", "192.168.0.9", "fd00::1",
                         "::ffff:127.0.0.1"), allow_private=True) == []
    still = refusals(_ips("169.254.169.254", "fe80::1", "224.0.0.1", "0.0.0.0", "::",
                          "255.255.255.255", "[::ffff:169.254.169.254]"), allow_private=True)
    assert [r.kind for r in still] == [LINK_LOCAL, LINK_LOCAL, MULTICAST, UNSPECIFIED,
                                       UNSPECIFIED, RESERVED, LINK_LOCAL]


@pytest.mark.parametrize(("name", "local"), [
    ("localhost", True), ("LOCALHOST.", True), ("localhost.", True), ("api.localhost", True),
    ("localhost.localdomain", True), ("localhost.example.com", False), ("mylocalhost", False),
])
def test_localhost_names(name: str, local: bool) -> None:
    assert is_localhost_name(name) is local


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False),
    ("192.168.1.10", False), ("gateway.example.com", False),
])
def test_loopback_bind_addresses(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback
