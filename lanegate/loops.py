"""The event loop lanegate's processes run on (setting ``event_loop``).

uvloop (libuv) spends less CPU per socket read and write than the standard
library's selector loop; at hundreds of live streams the gateway and the
workers are bound by exactly that. ``asyncio`` keeps the standard loop.

The loop is chosen per run, ``asyncio.Runner(loop_factory=...)`` (or a loop
handed to ``aiohttp.web.run_app``), never by setting the process-wide event-loop
policy, which Python 3.14 deprecates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from lanegate.settings import SettingsError

T = TypeVar("T")

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def loop_factory(name: str) -> LoopFactory:
    """What makes a loop of this kind; refuses ``uvloop`` when it is not installed."""
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:
            raise SettingsError("LANEGATE_EVENT_LOOP=uvloop, but uvloop is not installed "
                                "(pip install uvloop, or set LANEGATE_EVENT_LOOP=asyncio)"
                                ) from None
        factory: LoopFactory = uvloop.new_event_loop
        return factory
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], name: str) -> T:
    """``asyncio.run(main)`` on a loop of this kind."""
    with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
        return runner.run(main)


def new_loop(name: str) -> asyncio.AbstractEventLoop:
    """A new loop of this kind, for ``aiohttp.web.run_app(..., loop=...)``."""
    return loop_factory(name)()
