"""``python -m bench gpu`` at toy sizes on the CPU: the GPU run's script, end to end, so
that it works on the day a device is lent (real stacks, real Whisper, real streams)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.audio import SHARED_SPEECH
from bench.gpu import GpuOptions
from bench.sections import GPU, kept

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_SPEECH.exists(), reason="the shared recording is not here")
def test_the_gpu_run_works_at_toy_sizes_on_the_cpu(tmp_path: Path) -> None:
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nthe rest of the file\n")
    done = subprocess.run(
        [sys.executable, "-m", "bench", "gpu", "--toy", "--out", str(tmp_path / "out"),
         "--workdir", str(tmp_path / "work"), "--markdown", str(md)],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "results-gpu.json").read_text())
    toy = GpuOptions.toy_sizes()
    r = doc["results"]
    # cost: every segment length at every batch size, encoder and decoder apart
    assert {(row["seconds"], row["batch"]) for row in r["cost"]["rows"]} == \
        {(s, b) for s in toy.seconds for b in toy.batches}
    assert all(row["encode_ms"] > 0 and row["decode_ms"] > 0 for row in r["cost"]["rows"])
    frames = {row["seconds"]: row["frames"] for row in r["cost"]["rows"]}
    assert frames[4.0] > frames[2.0]  # frames grow with the segment
    assert r["cost"]["device"] == "cpu"
    # capacity: stepped from one stream, each step judged against the red line
    steps = r["capacity"]["steps"]
    assert steps[0]["streams"] == 1
    assert all(s["partial_ms"]["count"] > 0 for s in steps if "skipped" not in s)
    assert r["capacity"]["limit_ms"] == 300.0
    # flood: both designs, the dumps digested, the worker's steps scraped
    for design in ("split-nocap", "split"):
        f = r["flood"][design]
        assert f["errors"] == {}, f
        assert f["dump"]["dumps_digested"] >= 1
        assert f["steps"]["count"] > 0
    assert {s["design"] for s in doc["stacks"]} == {"split", "split-nocap"}
    assert r["run_wall_s"] < 600  # the toy run is far inside the GPU run's 10 minutes
    text = md.read_text()
    assert "the rest of the file" in text  # the section is put beside the rest
    section = GPU.find(text)
    assert section is not None
    assert "Toy run on the CPU" in section  # it never passes for a GPU figure
    assert "| `split-nocap` |" in section
    assert "| `split` |" in section
    assert GPU.find(kept(text)) == section  # a re-render of the rest keeps it


def test_the_gpu_run_says_plainly_when_no_gpu_is_there(tmp_path: Path) -> None:
    from bench.gpu import gpu_name
    if gpu_name() is not None:
        pytest.skip("a CUDA device is visible here")
    done = subprocess.run([sys.executable, "-m", "bench", "gpu", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "no CUDA device is visible" in done.stderr
    assert "--toy" in done.stderr
    assert not (tmp_path / "results-gpu.json").exists()
