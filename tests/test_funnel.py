"""The workstation funnel end to end on CPU (docs/funnel.md): a clean run and each planted negative.

Every stage runs for real: source runs in fresh processes, signals, capture, replays, reduce.  The
ablation is the micro-batch one (examples/ablation-microbatch.toml, 2 blocks): micro-batch 1 is a
real slowdown, so a generous step-time budget passes and a tight one fails; the replays' recorded
schedule order is checked against the order in which their files were written.

The clean run launches every step as a fresh ``python -m replayjob`` process, as the funnel does
(and so does ``scripts/local-mid-smoke.sh`` in test_deploy_chain.py); the planted negatives are
about where the funnel stops, not the process boundary, so they run the same step commands through
``replayjob.cli.main`` in this process (``in_process_steps``), saving the model stack's import in
every step.  Stage 1's source runs stay fresh processes everywhere: that is what it checks.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from replayjob import funnel as funnel_module
from replayjob.cli import main
from replayjob.funnel import FUNNEL_FILE, STATUS
from tests.conftest import REPO

SPEC = REPO / "examples" / "ablation-microbatch.toml"


def funnel(out: Path, *args: str, repeats: int = 2) -> tuple[int, dict[str, Any]]:
    code = main(["funnel", "--out", str(out), "--device", "cpu", "--spec", str(SPEC), "--repeats", str(repeats),
                 *args])
    doc = json.loads((out / FUNNEL_FILE).read_text())
    assert doc["exit_code"] == code and doc["schema"] == "replayjob.funnel/v1"
    assert [s["name"] for s in doc["stages"]] == ["determinism", "signals", "ablation"]
    return code, doc


@pytest.fixture
def in_process_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``replayjob.funnel.cli_step`` with the same command and log, run by ``main`` in this process."""
    def cli_step(args: Sequence[object], log: Path) -> int:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a", encoding="utf-8") as fh:
            fh.write("$ replayjob " + " ".join(str(a) for a in args) + "\n")
            fh.flush()
            with contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
                code = main([str(a) for a in args])
        return code if code in STATUS else 3

    monkeypatch.setattr(funnel_module, "cli_step", cli_step)


def budgets(tmp_path: Path, max_ratio: float) -> Path:
    p = tmp_path / f"budgets-{max_ratio}.toml"
    p.write_text(f'baseline = "mb-default"\n[mb-1]\nlocal_train_wall_s = {{ max_ratio = {max_ratio} }}\n'
                 'peak_memory_bytes = { max_ratio = 1.5 }\n')
    return p


def statuses(doc: dict[str, Any]) -> list[str]:
    return [s["status"] for s in doc["stages"]]


@pytest.mark.slow
def test_clean_funnel_passes_every_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "clean"
    code, doc = funnel(out, "--budgets", str(budgets(tmp_path, 50.0)))
    assert code == 0, doc["stages"]
    assert statuses(doc) == ["pass", "pass", "pass"]
    verdict = json.loads((out / "verdict.json").read_text())
    decisions = {b["metric"]: b["decision"] for b in verdict["budgets"]["bounds"]}
    assert decisions == {"local_train_wall_s": "pass", "peak_memory_bytes": "not_measurable"}
    assert (out / "report.md").is_file() and (out / "report.png").is_file()
    assert "Budgets" in (out / "report.md").read_text()
    arms = doc["summary"]["arms"]
    assert arms["mb-default"]["loss_equal_source"] and arms["mb-default"]["adapter_equal_source"]
    assert isinstance(arms["mb-1"]["adapter_equal_source"], bool)  # regrouped sums may round differently
    assert arms["mb-1"]["step_ratio"][0] > 1.0  # micro-batch 1 is slower
    printed = capsys.readouterr().out
    assert "ratio [95% interval]" in printed and "budget mb-1 local_train_wall_s max_ratio 50: pass" in printed
    # the replays ran interleaved, in the order their schedule records
    files = sorted((out / "replays").glob("*/*/replay_metrics.json"), key=lambda p: p.stat().st_mtime_ns)
    slots = [json.loads(p.read_text())["schedule"] for p in files]
    assert [(s["block"], s["position"]) for s in slots] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    arms_in_order = [p.parent.parent.name for p in files]
    assert arms_in_order[:2] == arms_in_order[2:][::-1]  # ABBA


@pytest.mark.usefixtures("in_process_steps")
def test_violated_budget_fails_once_decided(tmp_path: Path) -> None:
    """--until-decided: one block (one pair) cannot decide; a second block added by the funnel can."""
    code, doc = funnel(tmp_path / "tight", "--only-ablation", "--budgets", str(budgets(tmp_path, 1.05)),
                       "--until-decided", "--max-repeats", "2", repeats=1)
    assert code == 1 and statuses(doc) == ["skipped", "skipped", "fail"]
    assert doc["stages"][2]["artifacts"]["looks"] == "1 blocks: inconclusive, 2 blocks: fail"
    verdict = json.loads((tmp_path / "tight" / "verdict.json").read_text())
    assert verdict["budgets"]["procedure"]["max_looks"] == 2
    (row,) = [b for b in doc["summary"]["budgets"] if b["metric"] == "local_train_wall_s"]
    assert row["decision"] == "fail" and row["low"] > 1.05


@pytest.mark.slow
@pytest.mark.usefixtures("in_process_steps")
def test_planted_nondeterminism_stops_at_stage_one(tmp_path: Path) -> None:
    code, doc = funnel(tmp_path / "nd", "--plant-nondeterminism")
    assert code == 1 and statuses(doc) == ["fail", "skipped", "skipped"]
    assert "DRIFT" in doc["stages"][0]["detail"]
    assert not (tmp_path / "nd" / "replays").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("in_process_steps")
def test_planted_kill_stops_at_stage_two(tmp_path: Path) -> None:
    code, doc = funnel(tmp_path / "kill", "--plant-kill")
    assert code == 1 and statuses(doc) == ["pass", "fail", "skipped"]
    assert "planted_kill" in doc["stages"][1]["detail"]
    assert not (tmp_path / "kill" / "replays").exists()


@pytest.mark.usefixtures("in_process_steps")
def test_planted_undeclared_difference_stops_at_stage_three(tmp_path: Path) -> None:
    code, doc = funnel(tmp_path / "und", "--only-ablation", "--plant-undeclared")
    assert code == 2 and statuses(doc) == ["skipped", "skipped", "refused"]
    assert "replay of arm mb-default" in doc["stages"][2]["detail"]
    assert "undeclared" in (tmp_path / "und" / "steps.log").read_text()


@pytest.mark.slow
def test_init_makes_the_step_minus_one_state_for_a_local_model(tmp_path: Path) -> None:
    """`--model DIR` rests on `init --set model.path=DIR`: the state a capture from that model accepts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from replayjob.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, pad_token_id=tok.pad_id,
        bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, tie_word_embeddings=False))
    model.save_pretrained(tmp_path / "model", safe_serialization=True)
    ws, sets = tmp_path / "ws", ["--set", f'model.path="{tmp_path / "model"}"']
    assert main(["init", str(ws), *sets]) == 0
    state = json.loads((ws / "init_resume" / "trainer_state.json").read_text())
    assert state["step"] == -1 and state["model"]["kind"] == "local"
    assert main(["capture", str(ws / "source.toml"), "--out", str(ws / "source"), *sets]) == 0
    assert main(["capture", str(ws / "source.toml"), "--out", str(ws / "tiny")]) == 2  # the built-in model's


@pytest.mark.parametrize("args, needle", [
    (["--until-decided", "--max-repeats", "4"], "--until-decided needs budgets"),
    (["--design", "latin"], "--design must be one of abba, random"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--warmup-updates", "2"], "--warmup-updates needs --measured-updates"),
    (["--budgets", "b.toml", "--until-decided", "--max-repeats", "1"], "--max-repeats 1 is below"),
])
def test_funnel_usage_is_refused_before_any_work(tmp_path: Path, args: list[str], needle: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never"
    device = [] if "--device" in args else ["--device", "cpu"]
    assert main(["funnel", "--out", str(out), "--spec", str(SPEC), *device, *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.usefixtures("in_process_steps")
def test_the_specs_mixed_hardware_reaches_the_funnels_verdict(tmp_path: Path, mixed: bool) -> None:
    """Stage 3's look is `replayjob step reduce` (here in this process): the spec's `mixed_hardware` decides
    whether replays on two torch builds are refused.  The evidence is synthetic (replayjob.gate.synthetic,
    no training), laid out as the steps lay it out."""
    from replayjob.deploy import step
    from replayjob.funnel import Funnel, Options
    from replayjob.gate import synthetic

    text = SPEC.read_text().replace("repeats = 3\n", f"repeats = 3\nmixed_hardware = {str(mixed).lower()}\n")
    (spec := tmp_path / "spec.toml").write_text(text)
    f = Funnel(Options(out=tmp_path / "out", spec=spec, device="cpu", repeats=2, only_ablation=True),
               progress=lambda line: None)
    run_spec = f.run_spec()
    assert f.run_plan.mixed_hardware is mixed
    step.check_run_record(step.Layout.of(f.out), f.run_plan)  # as `step capture` writes it
    ev = synthetic.build(f.out, {a.name: dict(a.overrides) for a in f.run_plan.arms}, 3)
    for arm in f.run_plan.arms:  # the steps' layout: replays/ARM/BLOCK
        for i in range(3):
            (f.out / "replays" / arm.name / f"repeat-{i:03d}").rename(f.out / "replays" / arm.name / str(i))
    other = f.out / "replays" / f.run_plan.arms[1].name / "1" / "replay_metrics.json"
    doc = json.loads(other.read_text())
    doc["host"]["torch_version"] = "2.99.0"
    other.write_text(json.dumps(doc))
    assert len(ev.replay_files) == 6
    verdict = f.reduce(run_spec, blocks=2)
    (hw,) = [c for c in verdict["checks"] if c["name"] == "inputs.same_hardware"]
    assert hw["status"] == ("not_applicable" if mixed else "refused"), hw
    assert f"{f.run_plan.arms[1].name}#1" in hw["offenders"]
    # the look read its two blocks only (block 2 is on disk too)
    assert sorted(r["path"] for r in verdict["inputs"]["replays"]) == sorted(
        f"replays/{a.name}/{i}/replay_metrics.json" for a in f.run_plan.arms for i in range(2))
    assert (f.out / "report.md").is_file()
