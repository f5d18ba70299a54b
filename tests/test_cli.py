"""The CLI surface: help, version, usage errors, exit codes."""

from __future__ import annotations

import pytest

import replayjob
from replayjob.cli import COMMANDS, main


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"replayjob {name}" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == replayjob.__version__


@pytest.mark.parametrize("argv", [["nosuchcommand"], ["train"], ["init"], []])
def test_usage_errors_exit_2_without_traceback(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_bad_integer_option(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    assert main(["init", str(tmp_path), "--seed", "x"]) == 2
    assert "--seed expects an integer" in capsys.readouterr().err
