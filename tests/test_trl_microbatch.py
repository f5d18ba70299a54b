"""TRL's micro-batch arm end to end: a one-process capture per loss type, its baseline and micro-batch arm replayed,
then ``reduce --claim exact-input`` and the funnel on the capture.

The arm declares ``trl.per_device_train_batch_size`` only; the replay derives the accumulation steps and
``steps_per_generation`` from it (:func:`replayjob.runtime.knobs.trl_geometry`, the registry's ``predict`` hooks), and
the knobs-in-effect check must expect exactly the values the replay ran.  A planted expectation that keeps the captured
accumulation steps (the rule before the hooks) fails the same check.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the TRL tests need the 'trl' extra: pip install -e '.[trl]'")
os.environ["HF_HUB_OFFLINE"] = "1"

from conftest import grpo
from trl_scenario import MICRO

from replayjob.cli import main
from replayjob.launch import funnel as funnel_module
from replayjob.launch.funnel import FUNNEL_FILE, STATUS
from replayjob.runtime import knobs

pytestmark = pytest.mark.usefixtures("fresh_determinism_mode")

@pytest.fixture(scope="module")
def captures(trl_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One capture per loss type (LoRA dropout 0, step 2: a non-zero update), each by a real GRPOTrainer run on
    one process (per_device_train_batch_size 4, gradient accumulation 2)."""
    out = {}
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        d = tmp_path_factory.mktemp(f"trl_micro_{loss_type}")
        _, handle = grpo(trl_base, d, capture_step=2, lora_dropout=0.0, loss_type=loss_type)
        out[loss_type] = handle.result
    return out


def _checks(verdict: Path) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in json.loads(verdict.read_text())["checks"]}


def test_the_derived_knobs_come_from_one_rule() -> None:
    """The replay's geometry and the reduce expectation are the registry's hooks: 4 x 2 rows re-split into
    micro-batches of 2 run 4 accumulation steps and (dapo's ratio kept) steps_per_generation 4; a kept size keeps
    the arm's own values (a process-count change declares them)."""
    from replayjob.producers.trl.producer import resplit_geometry

    src = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_generation": 2}
    assert resplit_geometry(src, {**src, "per_device_train_batch_size": 2}, 8) == {
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "steps_per_generation": 4}
    assert resplit_geometry(src, {**src, "gradient_accumulation_steps": 1, "steps_per_generation": 1}, 8) == {
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "steps_per_generation": 1}
    source = {knobs.TRL_MICRO_BATCH: 4, knobs.TRL_ACCUMULATION: 2, knobs.TRL_STEPS_PER_GENERATION: 2}
    arm = {**source, knobs.TRL_MICRO_BATCH: 8}
    assert [knobs.KNOBS[k].expected(arm[k], 8, arm, source) for k in knobs.TRL_GEOMETRY] == [8, 1, 1]
    assert knobs.KNOBS[knobs.TRL_ACCUMULATION].expected(2, 8, arm) == 2  # no source geometry: as intended


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_reduce_passes_the_micro_batch_arm(loss_type: str, captures: dict[str, Any], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    res = captures[loss_type]
    reps = tmp_path / "replays"
    assert main(["replay", str(res.replay_toml), "--out", str(reps / "baseline"), "--repeat", "2"]) == 0
    assert main(["replay", str(res.replay_toml), "--out", str(reps / "micro"), "--repeat", "2", *MICRO]) == 0
    runtime = json.loads((reps / "micro" / "repeat-000" / "replay_metrics.json").read_text())["runtime"]
    assert (runtime[knobs.TRL_MICRO_BATCH], runtime[knobs.TRL_ACCUMULATION],
            runtime[knobs.TRL_STEPS_PER_GENERATION]) == (2, 4, 4)
    arms = "baseline,per_device_train_batch_size=2"
    args = ["reduce", str(reps), "--claim", "exact-input", "--source", str(res.out_dir), "--baseline", "baseline",
            "--arms", arms, "--min-repeats", "2"]
    assert main([*args, "--out", str(tmp_path / "exact.json")]) == 0
    check = _checks(tmp_path / "exact.json")["exact.knobs_in_effect"]
    assert check["status"] == "pass" and not check["offenders"]

    # the expectation without the derived rule (the captured accumulation steps) is a failed check, not a pass
    monkeypatch.setattr(knobs, "trl_geometry", lambda source, arm, rows: {k: arm.get(k) for k in knobs.TRL_GEOMETRY})
    assert main([*args, "--out", str(tmp_path / "planted.json")]) == 1
    planted = _checks(tmp_path / "planted.json")["exact.knobs_in_effect"]
    assert planted["status"] == "fail" and planted["offenders"]
    assert planted["observed"]["mismatched"]["per_device_train_batch_size=2#0"][knobs.TRL_ACCUMULATION] == {
        "observed": 4, "expected": 2}


@pytest.fixture
def in_process_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The funnel's step commands run by ``main`` in this process (as tests/test_funnel.py does)."""
    def cli_step(args: Sequence[object], log: Path) -> int:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a", encoding="utf-8") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
            code = main([str(a) for a in args])
        return code if code in STATUS else 3

    monkeypatch.setattr(funnel_module, "cli_step", cli_step)


@pytest.mark.slow
@pytest.mark.alone  # the funnel times warm updates
@pytest.mark.usefixtures("in_process_steps")
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_funnel_passes_the_micro_batch_arm(loss_type: str, captures: dict[str, Any], tmp_path: Path) -> None:
    """``funnel --capture`` with a baseline and a micro-batch arm: the exact-input gate (knobs in effect included)
    passes; the timing comparison is decided or the shared host contended with it (exit 3, nothing decided)."""
    (spec := tmp_path / "arms.toml").write_text(
        'name = "trlmicro"\nimage = "replayjob:dev"\nimage_policy = "local"\ngpu_product = "none"\n'
        'device = "cpu"\nrepeats = 1\n\n[arms.baseline]\n\n[arms.micro]\n"trl.per_device_train_batch_size" = 2\n')
    out = tmp_path / "funnel"
    code = main(["funnel", "--out", str(out), "--device", "cpu", "--spec", str(spec), "--claim", "exact-input",
                 "--capture", str(captures[loss_type].out_dir), "--no-report", "--fixed-blocks", "--repeats", "2",
                 "--warmup-updates", "1", "--measured-updates", "1"])
    doc = json.loads((out / FUNNEL_FILE).read_text())
    checks = _checks(out / "verdict.json")
    exact = {n: c["status"] for n, c in checks.items() if c["group"] == "exact-input"}
    assert exact and set(exact.values()) == {"pass"}, exact
    assert (code, doc["stages"][2]["status"]) in {(0, "pass"), (3, "contended")}, doc["stages"][2]
