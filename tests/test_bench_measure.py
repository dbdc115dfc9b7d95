"""bench.measure and bench.stack: the load processes go where the stack's plan puts them."""

from __future__ import annotations

from pathlib import Path

from bench.load import BYTES_PER_MS, StreamSpec
from bench.measure import run_load
from bench.stack import cpu_list


def test_cpu_lists_read_as_taskset_writes_them() -> None:
    assert cpu_list("0") == [0]
    assert cpu_list("0-2") == [0, 1, 2]
    assert cpu_list("3,0-1") == [0, 1, 3]


async def test_run_load_places_its_processes_on_the_planned_cpus(floor_url: str,
                                                                 tmp_path: Path) -> None:
    """Scenarios 1-3 pin the load to the realtime CPU; ``run_load`` checks each load
    process's affinity against the plan and refuses a window whose load ran elsewhere."""
    pcm = tmp_path / "speech.pcm"
    pcm.write_bytes(bytes(BYTES_PER_MS * 100 * 10))
    spec = StreamSpec(kind="live", url=floor_url, pcm_path=str(pcm), duration_s=1.0)
    results, _ = await run_load([spec], tmp_path, "pinned", timeout_s=60, cpus="0")
    assert [r["error"] for r in results] == [""]
    assert results[0]["frames_sent"] == 11  # the audio and `end`
