"""Settings: defaults, environment, flags, validation, and the README table."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import fields
from enum import Enum
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


# --- ranges (issue 34): every number finite and inside the range declared beside its field ----


@pytest.mark.parametrize(("name", "raw"), [
    ("LANEGATE_IDLE_TIMEOUT_S", "nan"),     # NaN: every comparison false, the timeout never fires
    ("LANEGATE_STEP_BUDGET_MS", "inf"),
    ("LANEGATE_MAX_SESSION_S", "-inf"),
    ("LANEGATE_PORT", "99999"),
    ("LANEGATE_PORT", "0"),
    ("LANEGATE_WORKER_PORT", "65536"),
    ("LANEGATE_MAX_KEY_SHARE", "1.5"),
    ("LANEGATE_MIN_REALTIME_RATIO", "2"),
    ("LANEGATE_COST_EWMA_ALPHA", "0"),
    ("LANEGATE_NO_SPEECH_THRESHOLD", "1.01"),
    ("LANEGATE_HEARTBEAT_S", "0"),
    ("LANEGATE_SLOTS", "0"),
    ("LANEGATE_VAD_AGGRESSIVENESS", "4"),
    ("LANEGATE_VAD_FRAME_MS", "25"),
    ("LANEGATE_LOGPROB_THRESHOLD", "nan"),
    ("LANEGATE_LOGPROB_THRESHOLD", "0.5"),
])
def test_out_of_range_values_are_refused_naming_the_variable(name: str, raw: str) -> None:
    with pytest.raises(SettingsError, match=f"^{name}=.*: (must|use one of)") as caught:
        Settings.from_env({name: raw})
    assert "\n" not in str(caught.value)


def test_every_number_declares_its_range_beside_its_field() -> None:
    for f in fields(Settings):
        if isinstance(f.default, int | float) and not isinstance(f.default, bool | Enum):
            assert "range" in f.metadata, f"{f.name}: declare its range in _s(...)"


def test_the_readme_table_states_each_range() -> None:
    table = markdown_table()
    assert "| `port` / `--port` | `LANEGATE_PORT` | `8080` | 1-65535 |" in table
    assert "| `max_key_share` | `LANEGATE_MAX_KEY_SHARE` | `0.5` | 0-1 |" in table


def test_a_bad_flag_is_refused_naming_the_flag() -> None:
    parser = argparse.ArgumentParser()
    add_cli_flags(parser)
    with pytest.raises(SettingsError,
                       match=r"^--port=99999 \(LANEGATE_PORT\): must be from 1 to 65535"):
        from_args(parser.parse_args(["--port", "99999"]))


@pytest.mark.parametrize(("argv", "env", "named"), [
    (["models", "--no-verify"], {"LANEGATE_IDLE_TIMEOUT_S": "nan"}, "LANEGATE_IDLE_TIMEOUT_S"),
    (["up", "--port", "99999"], {}, "--port"),
])
def test_the_command_refuses_a_bad_value_in_one_line(
        tmp_path: Path, argv: list[str], env: dict[str, str], named: str) -> None:
    """As an operator starts it: one line naming the variable, exit 2, no traceback."""
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("LANEGATE_")}
    run_env |= {"LANEGATE_DATA_DIR": str(tmp_path), "LANEGATE_ENGINE": "simulated", **env}
    done = subprocess.run([sys.executable, "-m", "lanegate.cli", *argv], env=run_env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert named in lines[0]
    assert "Traceback" not in done.stderr
