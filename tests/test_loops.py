"""The event loop lanegate's processes run on (setting ``event_loop``), chosen per run
with ``asyncio.Runner(loop_factory=...)``: the process-wide event-loop policy, which
Python 3.14 deprecates, is never set."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from lanegate.cli import main
from lanegate.loops import new_loop, run


async def _running_loop() -> type[asyncio.AbstractEventLoop]:
    return type(asyncio.get_running_loop())


@pytest.mark.parametrize(("name", "kind"), [("uvloop", uvloop.Loop),
                                            ("asyncio", asyncio.SelectorEventLoop)])
def test_run_uses_the_named_loop_and_leaves_the_policy_alone(
        name: str, kind: type[asyncio.AbstractEventLoop]) -> None:
    policy = asyncio.get_event_loop_policy()
    assert issubclass(run(_running_loop(), name), kind)
    assert asyncio.get_event_loop_policy() is policy
    loop = new_loop(name)  # what the gateway hands aiohttp's run_app
    try:
        assert isinstance(loop, kind)
    finally:
        loop.close()


def test_the_command_line_leaves_the_event_loop_policy_alone(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``lanegate`` chose the loop by setting uvloop's policy for the whole process."""
    monkeypatch.setenv("LANEGATE_EVENT_LOOP", "uvloop")
    policy = asyncio.get_event_loop_policy()
    assert main(["models", "--no-verify"]) == 0
    assert "base" in capsys.readouterr().out
    assert asyncio.get_event_loop_policy() is policy
    assert not isinstance(asyncio.get_event_loop_policy(), uvloop.EventLoopPolicy)
