"""Hints that name an action that works for a TRL capture: ``mismatch`` on a capture that kept no logprob source
says which TRL settings keep one (capturing again with this release would not help), and the replay config's
header names TRL's own knobs, each of which an override may set."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the TRL tests need the 'trl' extra: pip install -e '.[trl]'")
os.environ["HF_HUB_OFFLINE"] = "1"

from trl_scenario import capture

from replayjob.cli import main
from replayjob.mismatch.trl import NO_SOURCE_HINT
from replayjob.runtime import knobs

pytestmark = pytest.mark.usefixtures("fresh_determinism_mode")


@pytest.mark.slow
def test_mismatch_without_a_source_names_the_trl_settings_that_keep_one(
        trl_base: Path, trl_capture: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = capture(trl_base, tmp_path / "cap", step=1, num_iterations=1, bf16=False)  # generations used once
    capsys.readouterr()
    assert main(["mismatch", str(res.replay_toml), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["sources"] == [] and doc["decision"]["hint"] == NO_SOURCE_HINT
    assert "this release" not in doc["decision"]["hint"] and "num_iterations > 1" in doc["decision"]["hint"]
    # the action works: the shared capture (num_iterations 2) keeps TRL's old logprobs as a source
    capsys.readouterr()
    main(["mismatch", str(trl_capture["dir"] / "replay.toml"), "--json"])
    assert [s["name"] for s in json.loads(capsys.readouterr().out)["sources"]] == ["trainer_old"]


def test_the_trl_replay_config_names_trls_knobs(trl_capture: dict[str, Any]) -> None:
    header = "\n".join(line for line in trl_capture["result"].replay_toml.read_text().splitlines()
                       if line.startswith("#"))
    assert all(k in header for k in knobs.knobs_for("trl")) and "torch.<key>" not in header
