"""The blob store: audio bodies live in a directory (a shared volume in compose),
never inside Redis. Ids are server-generated; no client string becomes a path."""

from __future__ import annotations

import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

_ID = re.compile(r"^[0-9a-f]{32}$")


class BlobError(ValueError):
    """A blob id that the server did not generate."""


def new_id() -> str:
    return uuid.uuid4().hex


class BlobStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def dir(self, blob_id: str) -> Path:
        if not _ID.match(blob_id):
            raise BlobError(f"not a blob id: {blob_id!r}")
        return self.root / blob_id[:2] / blob_id

    def path(self, blob_id: str, name: str = "audio.pcm") -> Path:
        """Path of one file of a blob; the directory is created on demand."""
        if "/" in name or name.startswith("."):
            raise BlobError(f"bad blob file name: {name!r}")
        directory = self.dir(blob_id)
        directory.mkdir(parents=True, exist_ok=True)
        return directory / name

    def exists(self, blob_id: str, name: str = "audio.pcm") -> bool:
        return (self.dir(blob_id) / name).exists()

    def delete(self, blob_id: str) -> None:
        shutil.rmtree(self.dir(blob_id), ignore_errors=True)

    def older_than(self, age_s: float, now: float | None = None) -> Iterator[str]:
        """Ids of the blobs nothing was written to for ``age_s`` (by the newest mtime of
        the blob's directory and files)."""
        cutoff = (time.time() if now is None else now) - age_s
        for shard in self.root.iterdir():
            if not shard.is_dir():
                continue
            for blob in shard.iterdir():
                if _ID.match(blob.name) and _newest_mtime(blob) < cutoff:
                    yield blob.name


def _newest_mtime(directory: Path) -> float:
    try:
        newest = directory.stat().st_mtime
        for entry in directory.iterdir():
            newest = max(newest, entry.stat().st_mtime)
    except OSError:  # deleted meanwhile: not an orphan to sweep
        return float("inf")
    return newest
