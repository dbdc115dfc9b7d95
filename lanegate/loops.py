"""The event loop lanegate's processes run on (setting ``event_loop``).

uvloop (libuv) spends less CPU per socket read and write than the standard
library's selector loop; at hundreds of live streams the gateway and the
workers are bound by exactly that. ``asyncio`` keeps the standard loop.
"""

from __future__ import annotations

import asyncio

from lanegate.settings import SettingsError


def use_event_loop(name: str) -> None:
    """Make ``asyncio.run`` and ``aiohttp.web.run_app`` create loops of this kind."""
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:
            raise SettingsError("LANEGATE_EVENT_LOOP=uvloop, but uvloop is not installed "
                                "(pip install uvloop, or set LANEGATE_EVENT_LOOP=asyncio)"
                                ) from None
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    else:
        asyncio.set_event_loop_policy(None)
