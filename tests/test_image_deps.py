"""What the runtime image installs (issue 34): the dependencies the product imports are
declared and bounded, and what faster-whisper pulls in that lanegate never loads is left
out of the image (``Dockerfile``), with a decode that proves it is not needed."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib.metadata import distribution
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from phrases import RAIN

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: faster-whisper's Silero VAD runtime: lanegate finds speech with webrtcvad instead
UNUSED_ROOT = "onnxruntime"


def _name(raw: str) -> str:
    return re.sub(r"[-_.]+", "-", raw).lower()


def runtime_requirements() -> dict[str, Requirement]:
    reqs = (Requirement(r) for r in PYPROJECT["project"]["dependencies"])
    return {_name(r.name): r for r in reqs}


def needs(package: str, cut: str | None = None) -> set[str]:
    """``package`` and everything it installs, not going through ``cut``."""
    seen: set[str] = set()
    todo = [package]
    while todo:
        name = todo.pop()
        if name in seen or name == cut:
            continue
        seen.add(name)
        for raw in distribution(name).requires or []:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_name(req.name))
    return seen


def dockerfile_uninstalls() -> set[str]:
    text = (ROOT / "Dockerfile").read_text()
    found = re.findall(r"pip uninstall -y ((?:[\w.-]+ ?)+)", text)
    return {_name(n) for line in found for n in line.split()}


def test_what_the_product_imports_is_declared_and_bounded() -> None:
    declared = runtime_requirements()
    assert "ctranslate2" in declared  # engines/whisper.py imports it
    assert "yarl" in declared  # gateway and lanegate import it
    # engines/whisper.py uses faster-whisper internals (find_alignment, merge_punctuations)
    assert str(declared["faster-whisper"].specifier) in ("<2,>=1.2", ">=1.2,<2")


def test_the_image_leaves_out_only_what_nothing_loads() -> None:
    everything = needs("lanegate")
    without = needs("lanegate", cut=UNUSED_ROOT)
    # onnxruntime, and what only it brings (protobuf, flatbuffers): all of it, nothing else
    assert dockerfile_uninstalls() == everything - without
    assert UNUSED_ROOT in dockerfile_uninstalls()


def test_the_dockerfile_names_only_extras_that_exist() -> None:
    text = (ROOT / "Dockerfile").read_text()
    named = set(re.findall(r"\[(\w+)\]", text))
    assert named <= set(PYPROJECT["project"]["optional-dependencies"]), named


DECODE = """
import sys, wave
for name in sys.argv[3].split(","):
    sys.modules[name] = None  # as if not installed: importing it raises ImportError
from engines.whisper import WhisperEngine
from lanegate.settings import Settings
engine = WhisperEngine(Settings(data_dir=sys.argv[1]), slots=1)
with wave.open(sys.argv[2]) as w:
    pcm = w.readframes(w.getnframes())
print(engine.transcribe_batch([pcm])[0].text)
"""


def test_whisper_decodes_without_what_the_image_leaves_out(
        whisper_data: Path, speech: Any) -> None:
    """The image's engine: started and decoding with onnxruntime and its own
    dependencies unimportable (their modules, as the uninstall leaves them)."""
    modules = "onnxruntime,flatbuffers,google.protobuf"
    done = subprocess.run([sys.executable, "-c", DECODE, str(whisper_data), str(speech(RAIN)),
                           modules], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rain" in done.stdout.lower()
    assert "tomorrow" in done.stdout.lower()


def test_huggingface_hub_stays_because_faster_whisper_imports_it() -> None:
    """Not left out: ``faster_whisper/utils.py`` imports it when faster-whisper is
    imported (for downloads lanegate never makes). When that import goes, so can it."""
    done = subprocess.run([sys.executable, "-c", "import sys; sys.modules['huggingface_hub'] "
                           "= None; import faster_whisper"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode != 0
    assert "huggingface_hub" in done.stderr
    assert "huggingface-hub" not in dockerfile_uninstalls()
