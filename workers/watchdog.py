"""The step watchdog. A realtime step that runs past ``step_stall_s`` means a hung
engine, which nothing else notices: the engine call runs off the event loop, so the
worker keeps answering pings and heartbeats and stays listed with free slots. The
worker then takes no new sessions, leaves the registry and answers ``/readyz`` 503,
and ``workers/realtime.serve`` exits the process (a thread stuck in an engine cannot
be stopped) for the supervisor or the orchestrator to restart it.

An engine call that holds the GIL for good stops the event loop as well; that worker
falls silent, and the gateway's link deadline, the registry TTL and a liveness probe
on ``/healthz`` catch it instead.
"""

from __future__ import annotations

import asyncio
import time

from lanes.steploop import StepLoop

#: checks per ``step_stall_s``: a stall is seen at most a tenth of it late
CHECKS_PER_LIMIT = 10
#: exit status of a worker that stopped on a stalled step (EX_SOFTWARE)
EXIT_STALLED = 70


async def stalled_step(loop: StepLoop, stall_s: float) -> float:
    """Wait until a step of ``loop`` has run longer than ``stall_s``; how long it has."""
    period = stall_s / CHECKS_PER_LIMIT
    while True:
        await asyncio.sleep(period)
        started = loop.step_started
        if started is not None and (age := time.monotonic() - started) > stall_s:
            return age
