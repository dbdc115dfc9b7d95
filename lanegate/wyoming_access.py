"""When the gateway serves Wyoming, and how Home Assistant is pointed at it: the one
rule that the gateway (``gateway/wyoming.py``) and ``lanegate up``'s banner share.

Wyoming has no authentication: whoever reaches the port is a caller without a key. So
it is served exactly where such callers already are: while auth is off (no
``api_keys``), which the gateway allows only on a loopback ``host`` or with
``allow_anonymous`` (``gateway/app.py``). With API keys set the port stays closed, so
that it is never a way around them. docs/THREAT_MODEL.md, "Wyoming".
"""

from __future__ import annotations

from lanegate.settings import Settings


def closed_reason(settings: Settings) -> str | None:
    """Why the gateway does not serve Wyoming with these settings, or None when it does."""
    if settings.wyoming_port == 0:
        return "off (wyoming_port 0)"
    if settings.api_key_set:
        return ("off: API keys are set and Wyoming has no authentication "
                "(docs/THREAT_MODEL.md, \"Wyoming\")")
    return None


def shown_host(host: str) -> str:
    """The host a user types for a gateway bound to ``host`` (a wildcard: this machine's
    address on the network, which the gateway cannot know; loopback stands in)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def home_assistant_steps(settings: Settings) -> str:
    """Where to add it in Home Assistant (the banner's and README's words)."""
    host = shown_host(settings.host)
    if host == "127.0.0.1" and settings.host in ("0.0.0.0", "::", ""):
        host = "this machine's address"
    return ("Home Assistant: Settings > Devices & services > Add integration > "
            f"Wyoming Protocol, host {host}, port {settings.wyoming_port}")
