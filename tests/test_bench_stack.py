"""bench.stack: each stack's logs are kept after it stops, in the order the stacks ran,
though the next stack of the same design starts in the same directory afresh."""

from __future__ import annotations

from pathlib import Path

from bench.stack import LOGS_DIR, Stack, StackPlan


def stack_with_logs(workdir: Path, design: str, text: str) -> Stack:
    stack = Stack(StackPlan(design, {}, []), workdir)
    stack.workdir.mkdir(parents=True, exist_ok=True)
    for name in ("gateway", "worker-realtime-0"):
        (stack.workdir / f"{name}.log").write_text(f"{name} {text}\n")
    return stack


def test_every_stacks_logs_are_kept_in_the_order_they_ran(tmp_path: Path) -> None:
    kept = [stack_with_logs(tmp_path, design, f"round {k}").keep_logs()
            for k, design in enumerate(["split", "mixed", "split"])]
    assert [p.name for p in kept] == ["001-split", "002-mixed", "003-split"]
    assert all(p.parent == tmp_path / LOGS_DIR for p in kept)
    assert (kept[0] / "gateway.log").read_text() == "gateway round 0\n"
    assert (kept[2] / "worker-realtime-0.log").read_text() == "worker-realtime-0 round 2\n"
