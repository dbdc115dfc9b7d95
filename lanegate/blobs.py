"""The blob store: audio bodies live in a directory (a shared volume in compose),
never inside Redis. Ids are server-generated; no client string becomes a path."""

from __future__ import annotations

import re
import shutil
import uuid
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
