"""The gateway base URL that the clients take with ``--url``, as users type it.

``localhost:8080`` (no scheme) and ``http://127.0.0.1:8080/v1`` (the URL the banner
gives the OpenAI SDK) name the same gateway as ``http://127.0.0.1:8080``; the clients
add the API paths themselves, so both are normalized to a bare base URL.
"""

from __future__ import annotations

from yarl import URL

DEFAULT_URL = "http://127.0.0.1:8080"
SCHEMES = ("http", "https", "ws", "wss")
#: path suffixes a user may paste from the banner or the docs
API_SUFFIXES = ("/v1/stream", "/v1")


class BadURL(ValueError):
    """``--url`` does not name a gateway."""


def normalize_base_url(raw: str) -> str:
    """``http(s)://host[:port][/prefix]`` with no trailing ``/``, ``/v1`` or ``/v1/stream``
    (``ws``/``wss`` become ``http``/``https``: each client picks its own scheme)."""
    text = raw.strip()
    if not text:
        raise BadURL("--url is empty; give the gateway's address, e.g. " + DEFAULT_URL)
    if "://" not in text:
        text = "http://" + text
    try:
        url = URL(text)
        port = url.port  # yarl parses the port lazily: a non-numeric one raises here
    except ValueError as exc:
        raise BadURL(f"--url {raw!r} is not a URL: {exc}") from None
    if port is not None and not 0 < port < 65536:
        raise BadURL(f"--url {raw!r}: port {port} is out of range")
    if url.scheme not in SCHEMES:
        raise BadURL(f"--url {raw!r}: the scheme must be one of {', '.join(SCHEMES)}")
    if not url.host:
        raise BadURL(f"--url {raw!r} names no host; e.g. {DEFAULT_URL}")
    path = url.path.rstrip("/")
    for suffix in API_SUFFIXES:
        if path.endswith(suffix):
            path = path[: -len(suffix)]
            break
    scheme = {"ws": "http", "wss": "https"}.get(url.scheme, url.scheme)
    base = url.with_scheme(scheme).with_path(path or "/").with_query(None).with_fragment(None)
    return str(base).rstrip("/")
