"""A routing file is read by forced routing only: a replay config that names ``optimizer_batch.routing_path`` (or its
``routing_sha256``) while routing stays free was admitted with the file ignored, and forced routing needs both.
Each contradiction is refused by ``explain`` and ``replay`` alike (exit 2, naming the setting and the rule, no
traceback), whoever produced the capture; a free replay naming no file and a forced one naming both are admitted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import MOE, TRL_STEP, replay_pins

from replayjob.cli import main

DECLARED = ["--set", 'optimizer_batch.allow_config_differences=["model.routing"]']


@pytest.fixture(scope="module")
def moe_capture(moe_workspace: Path) -> dict[str, Any]:
    d = moe_workspace
    src = d / "source"
    entry = json.loads((src / "metrics.json").read_text())["routing/steps"][0]
    return {"config": str(d / "replay.toml"), "pins": [*replay_pins(src), *MOE], "file": src / entry["path"],
            "sha": entry["sha256"]}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


def _path(c: dict[str, Any]) -> list[str]:
    return ["--set", f'optimizer_batch.routing_path="{c["file"]}"']


def _sha(c: dict[str, Any]) -> list[str]:
    return ["--set", f'optimizer_batch.routing_sha256="{c["sha"]}"']


NEEDS_BOTH = "model.routing = 'forced' needs optimizer_batch.routing_path and its routing_sha256"
FREE_NAMED = "is named, but model.routing is 'free': only forced routing reads it"


@pytest.mark.parametrize(("case", "named"), [
    ("free with the file", "optimizer_batch.routing_path and routing_sha256: a routing file ("),
    ("free with the path alone", "optimizer_batch.routing_path: a routing file ("),
    ("free with the pin alone", f"optimizer_batch.routing_sha256: a routing file {FREE_NAMED}"),
    ("forced with the pin alone", NEEDS_BOTH),
    ("forced with the path alone", NEEDS_BOTH),
])
def test_a_routing_setting_the_routing_mode_contradicts_is_refused(
        case: str, named: str, moe_capture: dict[str, Any], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    c = moe_capture
    sets = {"free with the file": [*_path(c), *_sha(c)], "free with the path alone": _path(c),
            "free with the pin alone": _sha(c),
            "forced with the pin alone": ["--set", 'model.routing="forced"', *DECLARED, *_sha(c)],
            "forced with the path alone": ["--set", 'model.routing="forced"', *DECLARED, *_path(c)]}[case]
    for argv in (["explain", c["config"], *c["pins"], *sets],
                 ["replay", c["config"], *c["pins"], *sets, "--out", str(tmp_path / "r")]):
        code, text = _run(argv, capsys)
        assert code == 2 and named in text and "Traceback" not in text, (argv[0], text)
        assert case.startswith("forced") or FREE_NAMED in text, text
    assert not (tmp_path / "r").exists()


def test_free_routing_without_a_file_and_forced_routing_with_both_are_admitted(
        moe_capture: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    c = moe_capture
    assert _run(["explain", c["config"], *c["pins"]], capsys)[0] == 0
    forced = ["--set", 'model.routing="forced"', *DECLARED, *_path(c), *_sha(c)]
    code, text = _run(["explain", c["config"], *c["pins"], *forced], capsys)
    assert code == 0, text


def test_a_capture_api_replay_naming_a_routing_file_with_routing_free_is_refused(
        trl_capture: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same rule for the capture API's producers (TRL here): the file would be ignored by a free replay."""
    d = tmp_path / "cap"
    shutil.copytree(trl_capture["dir"], d, ignore=shutil.ignore_patterns("trainer"))
    name = f"optimizer_batch_step_{TRL_STEP:06d}.manifest.json"
    sets = ["--set", f'optimizer_batch.replay_path="{d / name}"',
            "--set", f'optimizer_batch.routing_path="{d / "routing.safetensors"}"',
            "--set", f'optimizer_batch.routing_sha256="{"a" * 64}"']
    code, text = _run(["explain", str(d / "replay.toml"), *sets[:4]], capsys)
    assert code == 2 and "optimizer_batch.routing_path: a routing file (" in text and FREE_NAMED in text, text
    code, text = _run(["explain", str(d / "replay.toml"), *sets], capsys)
    assert code == 2 and "optimizer_batch.routing_path and routing_sha256: a routing file (" in text, text
    assert "Traceback" not in text
    code, text = _run(["replay", str(d / "replay.toml"), *sets, "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "only forced routing reads it" in text and "Traceback" not in text, text
    assert not (tmp_path / "r" / "replay_metrics.json").exists()
    code, text = _run(["explain", str(d / "replay.toml"), sets[0], sets[1]], capsys)
    assert code == 0, text
