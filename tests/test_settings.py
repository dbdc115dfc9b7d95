"""Settings: defaults, environment, flags, validation, and the README table."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from lanegate.settings import (
    Settings,
    SettingsError,
    add_cli_flags,
    env_names,
    from_args,
    markdown_table,
)

README = Path(__file__).resolve().parent.parent / "README.md"


def test_defaults_match_the_design() -> None:
    s = Settings()
    assert (s.port, s.step_budget_ms, s.max_chunk_ms, s.sync_max_seconds) == (8080, 50.0, 200, 30.0)
    assert (s.max_window_s, s.soft_cut_search_s, s.lanes, s.engine) == (
        25.0, 3.0, "split", "whisper")


def test_environment_overrides_defaults_and_overrides_win() -> None:
    env = {"LANEGATE_PORT": "9999", "LANEGATE_CHUNK_CAP": "false", "LANEGATE_API_KEYS": "a, b,,"}
    s = Settings.from_env(env)
    assert s.port == 9999
    assert s.chunk_cap is False
    assert s.api_key_set == frozenset({"a", "b"})
    assert Settings.from_env(env, port=1234).port == 1234


@pytest.mark.parametrize(("name", "raw"), [("LANEGATE_PORT", "eighty"),
                                           ("LANEGATE_CHUNK_CAP", "maybe"),
                                           ("LANEGATE_LANES", "both"),
                                           ("LANEGATE_ENGINE", "julius"),
                                           ("LANEGATE_SLOTS", "-1")])
def test_bad_values_name_the_variable(name: str, raw: str) -> None:
    with pytest.raises(SettingsError, match=name):
        Settings.from_env({name: raw})


def test_to_env_round_trips() -> None:
    s = Settings(port=1, chunk_cap=False, lanes="mixed", step_budget_ms=12.5)
    assert Settings.from_env(s.to_env()) == s
    assert set(s.to_env()) == env_names()


def test_cli_flags_become_settings() -> None:
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    args = parser.parse_args(["--port", "7000", "--lanes", "mixed", "--slots", "3"])
    s = from_args(args)
    assert (s.port, s.lanes, s.slots) == (7000, "mixed", 3)
    assert from_args(parser.parse_args([])).port == Settings().port


def test_paths_expand_and_blob_dir_defaults_under_data_dir(tmp_path: Path) -> None:
    s = Settings(data_dir=str(tmp_path))
    assert s.blob_path == str(tmp_path / "blobs")
    assert Settings(data_dir=str(tmp_path), blob_dir="/x/y").blob_path == "/x/y"


def test_every_setting_is_documented_in_the_readme() -> None:
    readme = README.read_text()
    assert markdown_table() in readme, "README settings table is stale: run `lanegate settings`"
    for f in fields(Settings):
        assert f.metadata["doc"], f"{f.name} has no documentation"
