"""bench.instructions: the count it reads off a callgrind dump, and where it finds it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.instructions import CallgrindError, dumped_instructions, latest_dump

DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 4242
cmd:  python -m bench.floor --port 1
part: 2

positions: line
events: Ir
summary: 123456789

fl=(1) ???
fn=(1) main
0 10
totals: 123456789
"""


def test_the_count_is_the_dumps_total() -> None:
    assert dumped_instructions(DUMP) == 123_456_789


def test_a_dump_without_a_total_is_an_error() -> None:
    with pytest.raises(CallgrindError):
        dumped_instructions("events: Ir\n")


def test_the_latest_part_of_the_servers_dumps_is_read(tmp_path: Path) -> None:
    for part, total in ((1, 5), (2, 7), (10, 11)):
        (tmp_path / f"floor.callgrind.4242.{part}").write_text(f"totals: {total}\n")
    (tmp_path / "gateway.callgrind.4242.12").write_text("totals: 99\n")
    assert dumped_instructions(latest_dump(tmp_path, "floor", 4242)) == 11  # 10 after 2
    with pytest.raises(CallgrindError):
        latest_dump(tmp_path, "floor_protocol", 4242)
