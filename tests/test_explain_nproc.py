"""``replayjob explain --nproc N`` checks a replay on N processes by the rules ``replay --nproc N`` applies before it
launches them: the same refusals for the same configs, before any process starts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the TRL tests need the 'trl' extra: pip install -e '.[trl]'")
os.environ["HF_HUB_OFFLINE"] = "1"

from replayjob.cli import main

pytestmark = pytest.mark.usefixtures("fresh_determinism_mode")

DECLARED = ["--set", 'optimizer_batch.allow_config_differences=["distributed.num_processes", '
            '"trl.gradient_accumulation_steps", "trl.steps_per_generation"]']
KEPT = ["--set", "trl.gradient_accumulation_steps=1", "--set", "trl.steps_per_generation=1", *DECLARED]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_explain_nproc_applies_the_replays_process_count_rules(trl_capture_nodrop: dict[str, Any], tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    toml = str(trl_capture_nodrop["result"].replay_toml)  # one process, grpo, 2 micro-batches of 4 rows
    assert _run(capsys, "explain", toml)[0] == 0
    code, text = _run(capsys, "explain", toml, "--nproc", "2")  # the process count is an undeclared difference
    assert code == 2 and "undeclared difference 'distributed.num_processes'" in text, text
    # declared, but 2 processes x 2 accumulation steps would run 4 micro-batches of the captured 2
    code, text = _run(capsys, "explain", toml, "--nproc", "2",
                      "--set", 'optimizer_batch.allow_config_differences=["distributed.num_processes"]')
    assert code == 2 and "set trl.gradient_accumulation_steps = 1 (declared)" in text, text
    rcode, rtext = _run(capsys, "replay", toml, "--out", str(tmp_path / "r"), "--nproc", "2",
                        "--set", 'optimizer_batch.allow_config_differences=["distributed.num_processes"]')
    assert rcode == 2 and "set trl.gradient_accumulation_steps = 1 (declared)" in rtext  # the replay's own refusal
    assert not (tmp_path / "r").exists()  # refused before any process started
    code, text = _run(capsys, "explain", toml, "--nproc", "2", *KEPT, "--json")
    assert code == 0, text
    code, text = _run(capsys, "explain", toml, "--nproc", "0")
    assert code == 2 and "--nproc must be" in text


def test_explain_nproc_refuses_a_producer_that_replays_in_one_process(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    shutil.copy(repo / "examples" / "plain_torch_loop.py", tmp_path / "loop.py")
    proc = subprocess.run([sys.executable, str(tmp_path / "loop.py"), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=300, check=False, env={**os.environ, "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    toml = str(tmp_path / "out" / "capture" / "replay.toml")
    assert _run(capsys, "explain", toml, "--nproc", "1")[0] == 0
    code, text = _run(capsys, "explain", toml, "--nproc", "2")
    assert code == 2 and "a torch replay runs in one process" in text and "Traceback" not in text, text


def test_a_capture_refuses_a_trainer_on_fewer_processes_than_launched(trl_base: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's WORLD_SIZE is the process count asked for; a trainer that runs on another (built outside the
    launched processes' group) is refused before training, and a one-process run records that none was asked."""
    from conftest import grpo

    from replayjob.producers.api import capture as cap
    from replayjob.producers.trl.producer import capture_optimizer_batch

    trainer, _ = grpo(trl_base, tmp_path / "a", train=False)
    launched = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for k, v in launched.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(cap.CaptureError, match=r"started 2 processes \(WORLD_SIZE\) but the trainer runs on 1"):
        capture_optimizer_batch(trainer, tmp_path / "out", step=0)
    assert not (tmp_path / "out").exists()
    for k in launched:
        monkeypatch.delenv(k)
    _, handle = grpo(trl_base, tmp_path / "b", capture_step=0, max_steps=1)
    launch = json.loads(handle.result.manifest.read_text())["framework_state"]["launch"]
    assert launch == {"requested_processes": None, "processes": 1}
