"""The console script: every subcommand parses, dispatches to a real module, and
answers --help; bad settings exit 2 with a message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lanegate.cli import COMMANDS, build_parser, main, resolve


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_resolves_to_a_callable(command: str) -> None:
    assert callable(resolve(COMMANDS[command]))


@pytest.mark.parametrize("command", [*sorted(COMMANDS), "settings"])
def test_help_runs(command: str) -> None:
    extra = ["--lane", "realtime"] if command == "worker" else []
    out = subprocess.run([sys.executable, "-m", "lanegate.cli", command, *extra, "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: lanegate" in out.stdout


def test_worker_needs_a_lane() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker"])


def test_bad_setting_exits_2_with_the_variable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway", "--lanes", "sideways"]) == 2
    assert "LANEGATE_LANES" in capsys.readouterr().err


def test_settings_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["settings"]) == 0
    assert "LANEGATE_STEP_BUDGET_MS" in capsys.readouterr().out
