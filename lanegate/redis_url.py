"""Redis URLs: a plain Redis or one behind Sentinel (``parse_redis_url``, pure).

* ``redis://``, ``rediss://``, ``unix://``: redis-py's ``Redis.from_url``.
* ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]``:
  the sentinels (port 26379 unless given) are asked for ``service``'s primary
  (``lanegate/redis_io.py`` builds the client). The password is the data nodes';
  sentinels that need their own take ``?sentinel_password=...`` (and
  ``sentinel_username``). Percent-encode ``@ : / , ?`` in a password.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

DIRECT_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")


class RedisUrlError(ValueError):
    """A Redis URL that cannot be used; the message says what is wrong."""


@dataclass(frozen=True)
class DirectTarget:
    """A Redis reached at the URL itself."""

    url: str


@dataclass(frozen=True)
class SentinelTarget:
    """A Redis primary found through sentinels."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None


RedisTarget = DirectTarget | SentinelTarget


def parse_redis_url(url: str) -> RedisTarget:
    """What ``url`` points at; ``RedisUrlError`` if it cannot be used."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme:
        raise RedisUrlError(f"{_shown(url)!r} is not a URL (redis://host:port/db or "
                            f"{SENTINEL_SCHEME}://host:port/service)")
    scheme = scheme.lower()
    if scheme in DIRECT_SCHEMES:
        return DirectTarget(url)
    if scheme != SENTINEL_SCHEME:
        raise RedisUrlError(f"unknown Redis URL scheme {scheme!r}: use one of "
                            f"{', '.join((*DIRECT_SCHEMES, SENTINEL_SCHEME))}")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    service, db = _service_and_db(path)
    options = _options(query)
    return SentinelTarget(
        sentinels=tuple(_host_port(part) for part in hosts.split(",")),
        service_name=service, db=db, username=username, password=password,
        sentinel_username=options.get("sentinel_username"),
        sentinel_password=options.get("sentinel_password"),
    )


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    if not colon:  # redis://secret@host is a password, as redis-py reads it
        return None, unquote(user) or None
    return unquote(user) or None, unquote(password) or None


def _host_port(part: str) -> tuple[str, int]:
    part = part.strip()
    if part.startswith("["):  # [::1]:26379
        host, bracket, tail = part[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise RedisUrlError(f"bad sentinel address {part!r}")
        port_text = tail[1:]
    else:
        host, _, port_text = part.partition(":")
    if not host:
        raise RedisUrlError("a sentinel URL needs at least one host: "
                            f"{SENTINEL_SCHEME}://host:port[,host:port]/service")
    if not port_text:
        return host, SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise RedisUrlError(f"bad port {port_text!r} in sentinel address {part!r}")
    return host, int(port_text)


def _service_and_db(path: str) -> tuple[str, int]:
    parts = path.split("/") if path else []
    if parts and parts[-1] == "":
        parts.pop()  # a trailing slash
    if not parts or not parts[0]:
        raise RedisUrlError(f"a sentinel URL names its service: "
                            f"{SENTINEL_SCHEME}://host:port/service_name[/db]")
    if len(parts) > 2:
        raise RedisUrlError(f"too many path parts in {'/' + path!r}: /service_name[/db]")
    if len(parts) == 1:
        return unquote(parts[0]), 0
    if not parts[1].isdigit():
        raise RedisUrlError(f"the database must be a number, not {parts[1]!r}")
    return unquote(parts[0]), int(parts[1])


def _options(query: str) -> dict[str, str]:
    values = parse_qs(query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(values) - set(SENTINEL_OPTIONS))
    if unknown:
        raise RedisUrlError(f"unknown sentinel URL option {unknown[0]!r}: use "
                            f"{' or '.join(SENTINEL_OPTIONS)}")
    return {key: items[-1] for key, items in values.items() if items[-1]}


def _shown(url: str) -> str:
    """``url`` without a password, for an error message."""
    _, at, tail = url.rpartition("@")
    return f"***@{tail}" if at else url
