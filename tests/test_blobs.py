"""The blob store: server-generated ids only, nothing outside its root."""

from __future__ import annotations

from pathlib import Path

import pytest

from lanegate.blobs import BlobError, BlobStore, new_id


def test_write_read_delete(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    blob = new_id()
    store.path(blob).write_bytes(b"\x00\x01")
    assert store.exists(blob)
    assert store.path(blob).resolve().is_relative_to(tmp_path.resolve())
    store.delete(blob)
    assert not store.exists(blob)


@pytest.mark.parametrize("bad", ["../../etc", "x" * 32, "", "A" * 32, new_id() + "/.."])
def test_client_strings_never_become_paths(tmp_path: Path, bad: str) -> None:
    with pytest.raises(BlobError):
        BlobStore(tmp_path).path(bad)


@pytest.mark.parametrize("name", ["../audio.pcm", ".hidden", "a/b"])
def test_file_names_stay_inside_the_blob(tmp_path: Path, name: str) -> None:
    with pytest.raises(BlobError):
        BlobStore(tmp_path).path(new_id(), name)
