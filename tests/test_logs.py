"""Log rendering follows structlog's convention: readable lines on a terminal, JSON lines
elsewhere, or what ``log_format`` says. Checked on a real process (``lanegate gateway``
without a Redis URL logs one error and exits 2) with stderr a pipe or a pseudo-terminal."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import on_terminal
from stack import REPO


def gateway_stderr(*, tty: bool, log_format: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LANEGATE_")}
    if log_format is not None:
        env["LANEGATE_LOG_FORMAT"] = log_format
    argv = [sys.executable, "-m", "lanegate.cli", "gateway"]
    if not tty:
        done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 2
        return done.stderr
    code, shown = on_terminal(argv, stream="stderr", cwd=REPO, env=env, timeout_s=60)
    assert code == 2
    return shown


def test_a_pipe_gets_json_lines() -> None:
    lines = [json.loads(line) for line in gateway_stderr(tty=False).splitlines()]
    assert [line["event"] for line in lines] == ["no_redis_url"]
    assert lines[0]["level"] == "error"
    assert lines[0]["process"] == "gateway"


def test_a_terminal_gets_readable_lines() -> None:
    text = re.sub(r"\x1b\[[0-9;]*m", "", gateway_stderr(tty=True))  # colours
    assert "no_redis_url" in text
    assert "process=" in text  # key=value pairs, not a JSON object
    assert not text.lstrip().startswith("{")


@pytest.mark.parametrize(("tty", "log_format", "is_json"), [
    (False, "console", False), (True, "json", True), (False, "auto", True),
])
def test_log_format_overrides_the_guess(tty: bool, log_format: str, is_json: bool) -> None:
    text = gateway_stderr(tty=tty, log_format=log_format).strip()
    assert "no_redis_url" in text
    assert text.startswith("{") is is_json


def test_a_bad_log_format_is_refused() -> None:
    env = {**os.environ, "LANEGATE_LOG_FORMAT": "xml"}
    done = subprocess.run([sys.executable, "-m", "lanegate.cli", "gateway"], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "LANEGATE_LOG_FORMAT" in done.stderr
