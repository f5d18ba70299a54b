"""Always-on capture: chosen steps of a longer run and the ring buffer, captured, explained, replayed.

Two real source runs per module (the built-in tiny model on CPU, a smaller step than the
default): six steps capturing step 3, and five steps with a ring buffer of three where
``REPLAYJOB_FAULT_NONFINITE_GRAD=4`` plants a NaN gradient at step 4.  Refusals run in process on
copies.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import torch

from replayjob.artifacts import capture_manifest as manifest
from replayjob.artifacts.metrics import read_steps
from replayjob.cli import main
from replayjob.config import load_config
from replayjob.crashpoints import NONFINITE_GRAD_ENV
from replayjob.digest import sha256_file
from replayjob.errors import ArtifactExistsError, ConfigError, IntegrityError
from replayjob.producers.builtin import ring
from replayjob.producers.builtin import steps as stepcapture
from replayjob.rl.state import OPTIMIZER_FILE, read_state, write_state

SMALL = ["algorithm.prompts_per_step=2", "algorithm.group_size=4", "inference.max_new_tokens=4"]
STEP3 = "replay_step_000003.toml"


def sets(*items: str) -> list[str]:
    return [x for s in (*SMALL, *items) for x in ("--set", s)]


def metrics(run: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((run / "metrics.json").read_text())
    return out


def diag(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "diag.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def steps_run(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("steps") / "run"
    assert main(["train", str(workspace / "train.toml"), "--out", str(out),
                 *sets("training.max_steps=6", "optimizer_batch.capture_steps=[3]")]) == 0
    return out


@pytest.fixture(scope="module")
def ring_run(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ring") / "run"
    os.environ[NONFINITE_GRAD_ENV] = "4"
    try:
        assert main(["train", str(workspace / "train.toml"), "--out", str(out),
                     *sets("training.max_steps=5", "optimizer_batch.ring_size=3")]) == 0
    finally:
        del os.environ[NONFINITE_GRAD_ENV]
    return out


def replay_metrics(config: Path, out: Path, *extra: str) -> dict[str, Any]:
    assert main(["replay", str(config), "--out", str(out), *extra]) == 0
    doc: dict[str, Any] = json.loads((out / "replay_metrics.json").read_text())
    return doc


def test_a_chosen_step_of_a_six_step_run_replays_bitwise(steps_run: Path, tmp_path: Path) -> None:
    (pins,) = metrics(steps_run)["optimizer_batch/steps"]
    assert pins["step"] == 3 and pins["replay_config"] == STEP3 and pins["nonfinite_inputs"] is False
    (read,) = read_steps(steps_run)  # the one reader of chosen steps (the capture API writes the same record)
    assert (read.step, read.manifest, read.final_adapter) == (3, pins["manifest_sha256"], pins["final_adapter_sha256"])
    assert read.replay_config == steps_run / STEP3
    assert (read.loss, read.grad_norm) == (diag(steps_run)[3]["loss"]["policy"], diag(steps_run)[3]["grad_norm"])
    for name in stepcapture.file_names(3):
        assert (steps_run / name).exists(), name
    state = read_state(steps_run / stepcapture.state_dir_name(3))
    assert state.step == 2 and state.has_optimizer and state.adapter_sha256 == pins["initial_adapter_sha256"]
    assert main(["explain", str(steps_run / STEP3)]) == 0  # the ready config carries both pins
    rm = replay_metrics(steps_run / STEP3, tmp_path / "r")
    assert rm["optimizer_batch/final_adapter_sha256"] == pins["final_adapter_sha256"]
    assert rm["optimizer_batch/manifest_sha256"] == pins["manifest_sha256"]
    source_step = diag(steps_run)[3]
    assert rm["loss"] == source_step["loss"]["policy"] and rm["grad_norm"] == source_step["grad_norm"]
    # the adapter the step started from is not the run's initial one: the state really is step 2's
    assert pins["initial_adapter_sha256"] != metrics(steps_run)["initial_adapter_sha256"]


def test_capture_does_not_change_training(steps_run: Path, ring_run: Path) -> None:
    """Steps 0-3 of the two runs (different captures, same config) agree in every checksum."""
    a, b = diag(steps_run)[:4], diag(ring_run)[:4]
    assert [r["checksums"] for r in a] == [r["checksums"] for r in b]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def _copy(steps_run: Path, tmp_path: Path) -> Path:
    d = tmp_path / "copy"
    shutil.copytree(steps_run, d)
    return d


def test_a_chosen_step_is_refused_from_any_other_start_state(steps_run: Path, workspace: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    cfg = steps_run / STEP3
    assert main(["explain", str(cfg), "--set", f"resume.from='{workspace / 'init_resume'}'"]) == 2
    err = capsys.readouterr().err
    assert "state at step -1; step 3 starts from the state of step 2" in err and "adapter hash mismatch" in err
    # a re-pinned optimizer state (trainer_state.json rewritten to match): the manifest's pin still refuses
    d = _copy(steps_run, tmp_path)
    sdir = d / stepcapture.state_dir_name(3)
    opt = sdir / OPTIMIZER_FILE
    from safetensors.torch import load_file, save_file

    tensors = load_file(opt)
    name = next(k for k in tensors if k.endswith("exp_avg"))
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, opt, metadata={"format": "replayjob-optimizer"})
    old = read_state(steps_run / stepcapture.state_dir_name(3))
    write_state(sdir, 2, old.model, {})  # re-hash what is there, as whoever edits the files can
    assert main(["explain", str(d / STEP3)]) == 2
    assert "optimizer state mismatch" in capsys.readouterr().err
    assert main(["explain", str(cfg), "--set", "optimizer.lr=0.002",
                 "--set", f"resume.from='{steps_run / stepcapture.state_dir_name(3)}'"]) == 2
    assert "learning rate differs" in capsys.readouterr().err


def test_the_planted_nonfinite_gradient_writes_the_ring_which_replays(ring_run: Path, tmp_path: Path) -> None:
    m = metrics(ring_run)
    r = m["optimizer_batch/ring"]
    assert r["trigger"]["step"] == 4 and "non-finite" in r["trigger"]["reason"]
    assert [w["step"] for w in r["written"]] == [2, 3, 4] and r["steps_observed"] == 5
    assert r["peak_bytes"] > 0 and r["training_thread_s"] > 0
    assert math.isnan(diag(ring_run)[4]["grad_norm"]) and m["grad_norm"] is None  # strict JSON in metrics
    written = {w["step"]: w for w in r["written"]}
    for earlier, later in ((2, 3), (3, 4)):  # every entry is self-sufficient: its own start state
        assert written[earlier]["final_adapter_sha256"] == written[later]["initial_adapter_sha256"]
    assert written[4]["final_adapter_sha256"] == m["final_adapter_sha256"]  # the NaN update's adapter
    for step in (2, 3):  # the buffered steps before the fault replay bitwise
        rm = replay_metrics(ring_run / written[step]["replay_config"], tmp_path / f"r{step}")
        assert rm["optimizer_batch/final_adapter_sha256"] == written[step]["final_adapter_sha256"]
        assert rm["loss"] == diag(ring_run)[step]["loss"]["policy"]
    # the triggering step replays its inputs; the fault planted into its update is not part of them
    assert written[4]["grad_norm"] is None and written[3]["grad_norm"] == diag(ring_run)[3]["grad_norm"]  # NaN: null
    rm = replay_metrics(ring_run / written[4]["replay_config"], tmp_path / "r4")
    assert math.isfinite(rm["grad_norm"]) and rm["optimizer_batch/manifest_sha256"] == written[4]["manifest_sha256"]


def test_triggers() -> None:
    def fire(*overrides: str, loss: float = 1.0, norm: float = 1.0, norms: tuple[float, ...] = (1.0, 1.0),
             losses: tuple[float, ...] = (1.0,)) -> str | None:
        cfg = load_config(None, [f"optimizer_batch.{o}" for o in overrides])
        return ring.triggered(cfg, loss, norm, deque(norms), deque(losses))

    assert fire() is None
    assert "non-finite" in str(fire(norm=float("nan"))) and "non-finite" in str(fire(loss=float("inf")))
    assert fire("ring_grad_norm_above=2.0", norm=2.0) is None
    assert "above 2.0" in str(fire("ring_grad_norm_above=2.0", norm=2.5))
    assert fire("ring_grad_norm_median_multiple=3.0", norm=2.9, norms=(1.0, 1.0, 5.0)) is None
    assert "running median" in str(fire("ring_grad_norm_median_multiple=3.0", norm=3.1, norms=(1.0, 1.0, 5.0)))
    assert fire("ring_grad_norm_median_multiple=3.0", norm=50.0, norms=()) is None  # no history yet
    assert "|loss|" in str(fire("ring_loss_spike_multiple=4.0", loss=-4.5, losses=(1.0,)))


def test_config_and_precondition_refusals(workspace: Path, tmp_path: Path) -> None:
    from replayjob.producers.builtin.capture import StepsCapture
    from replayjob.producers.builtin.ring import RingCapture

    for bad, where in (("optimizer_batch.capture_steps=[-1]", "capture_steps"),
                       ("optimizer_batch.capture_steps=[2, 2]", "capture_steps"),
                       ("optimizer_batch.ring_size=-1", "ring_size"),
                       ("optimizer_batch.ring_grad_norm_above=-1.0", "ring_grad_norm_above")):
        with pytest.raises(ConfigError) as exc:
            load_config(None, [bad])
        assert where in str(exc.value.where)
    cfg = load_config(workspace / "train.toml", ["training.max_steps=3", "optimizer_batch.capture_steps=[3]"])
    with pytest.raises(ConfigError, match="not reached"):
        StepsCapture.prepare(cfg, tmp_path)
    both = load_config(workspace / "source.toml", ["optimizer_batch.capture_steps=[0]"])
    with pytest.raises(ConfigError, match="cannot be combined"):
        StepsCapture.prepare(both, tmp_path)
    cfg = load_config(workspace / "train.toml", ["training.max_steps=3", "optimizer_batch.capture_steps=[1]"])
    (tmp_path / manifest.replay_config_name(1)).write_text("")
    with pytest.raises(ArtifactExistsError):
        StepsCapture.prepare(cfg, tmp_path)
    (tmp_path / ring.RING_DIR).mkdir()
    with pytest.raises(ArtifactExistsError):
        RingCapture.prepare(load_config(None, ["optimizer_batch.ring_size=2"]), tmp_path)


def test_manifest_state_section_is_validated(steps_run: Path) -> None:
    path = steps_run / manifest.manifest_name(3)
    doc = json.loads(path.read_text())
    assert manifest.validate(doc, path)["state"]["step"] == 2
    for mutate, cause in ((lambda d: d["state"].update(step=1), "'state.step' must be 2"),
                          (lambda d: d["state"].update(dir="../x"), "bare directory name"),
                          (lambda d: d["state"].update(lr=[float("nan")]), "field `state.lr\\[0\\]`"),
                          (lambda d: d["state"].pop("nonfinite_inputs"), "missing required field `nonfinite_inputs`"),
                          # the step names its files: another step's state or payload is a relabel
                          (lambda d: d["state"].update(dir="optimizer_batch_step_000002.state"),
                           "'state.dir' is 'optimizer_batch_step_000002.state', but step 3's start state is "
                           "'optimizer_batch_step_000003.state'"),
                          (lambda d: d["state"].update(dir="elsewhere.state"), "'state.dir' is 'elsewhere.state'"),
                          (lambda d: d["payload"].update(file="optimizer_batch_step_000002.safetensors"),
                           "'payload.file' is 'optimizer_batch_step_000002.safetensors', but step 3's payload is "
                           "'optimizer_batch_step_000003.safetensors'"),
                          (lambda d: d.pop("state"), "'step' must be 0")):
        bad = json.loads(path.read_text())
        mutate(bad)
        with pytest.raises(IntegrityError, match=cause):
            manifest.validate(bad, path)


def test_nonfinite_rows_are_flagged() -> None:
    from replayjob.rl.batch import OptimizerBatch

    m = torch.ones((1, 2), dtype=torch.float64)
    fields = {k: m for k in ("old_logprobs", "ref_logprobs", "advantages", "loss_weights")}
    assert not stepcapture.has_nonfinite(OptimizerBatch.from_padded([[1, 2, 3]], [1], fields, m))
    nan = m.clone()
    nan[0, 1] = float("nan")
    assert stepcapture.has_nonfinite(OptimizerBatch.from_padded([[1, 2, 3]], [1], {**fields, "old_logprobs": nan}, m))


def test_the_run_records_each_steps_files_once(steps_run: Path) -> None:
    """Capture files are never rewritten: the pins in metrics.json match the files on disk."""
    (pins,) = metrics(steps_run)["optimizer_batch/steps"]
    from replayjob.digest import sha256_bytes

    assert sha256_bytes((steps_run / pins["manifest_path"]).read_bytes()) == pins["manifest_sha256"]
    state = steps_run / stepcapture.state_dir_name(3)
    assert sha256_file(state / "adapter_model.safetensors") == pins["initial_adapter_sha256"]


def test_nonfinite_inputs_are_flagged_and_replay_only_under_the_opt_in(workspace: Path, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A source whose reference logprobs hold a NaN (unused by the loss: kl_loss_coef = 0)."""
    from replayjob.launch.source_run import train_source
    from replayjob.rl.batch import OptimizerBatch
    from replayjob.rl.hooks import StepHook

    class Poison(StepHook):  # runs before the capture hook, as a broken reference model would
        def before_update(self, step: int, batch: OptimizerBatch) -> None:
            if step == 1:
                batch.ref_logprobs[0] = float("nan")

    cfg = load_config(workspace / "train.toml", [*SMALL, "training.max_steps=2", "optimizer_batch.capture_steps=[1]"])
    out = tmp_path / "run"
    (pins,) = train_source(cfg, out, [Poison()])["optimizer_batch/steps"]
    assert pins["nonfinite_inputs"] is True
    config = out / manifest.replay_config_name(1)
    assert main(["explain", str(config)]) == 2
    err = capsys.readouterr().err
    assert "flagged nonfinite_inputs" in err and "non-finite ref_logprobs" in err
    rm = replay_metrics(config, tmp_path / "r", "--set", "optimizer_batch.allow_nonfinite_inputs=true")
    assert rm["optimizer_batch/final_adapter_sha256"] == pins["final_adapter_sha256"]
    # the flag edited to false and the manifest re-pinned: recomputed from the rows, refused either way
    sha = _reflag(out / manifest.manifest_name(1), False)
    for opt_in in ("false", "true"):
        assert main(["explain", str(config), "--set", f'optimizer_batch.expected_manifest_sha256="{sha}"',
                     "--set", f"optimizer_batch.allow_nonfinite_inputs={opt_in}"]) == 2
        err = capsys.readouterr().err
        assert "field `state.nonfinite_inputs` is false, but the payload's rows hold non-finite values" in err, err
        assert "non-finite ref_logprobs" in err


def _reflag(path: Path, flag: bool) -> str:
    """Set the manifest's ``state.nonfinite_inputs`` and re-pin it, as whoever edits the capture can."""
    from replayjob.digest import sha256_bytes
    from replayjob.jsonio import canonical_bytes

    doc = json.loads(path.read_text())
    doc["state"]["nonfinite_inputs"] = flag
    data = canonical_bytes(doc) + b"\n"
    path.write_bytes(data)
    return sha256_bytes(data)


def test_a_nonfinite_flag_over_finite_rows_is_refused(steps_run: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``state.nonfinite_inputs`` is recomputed from the payload: set over all-finite rows (re-pinned), it is
    refused with and without the opt-in, and the refusal never says the rows hold NaN."""
    d = _copy(steps_run, tmp_path)
    sha = _reflag(d / manifest.manifest_name(3), True)
    for opt_in in ("true", "false"):
        assert main(["explain", str(d / STEP3), "--set", f'optimizer_batch.expected_manifest_sha256="{sha}"',
                     "--set", f"optimizer_batch.allow_nonfinite_inputs={opt_in}"]) == 2
        err = capsys.readouterr().err
        assert "field `state.nonfinite_inputs` is true, but the payload's rows hold no non-finite value" in err, err
        assert str(d / manifest.manifest_name(3)) in err and "rows hold non-finite values" not in err


@pytest.mark.parametrize("what", ["directory", "file"])
def test_a_linked_start_state_is_refused(steps_run: Path, tmp_path: Path, what: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The capture's state directory (or a file in it) moved outside and linked back: refused, naming the link,
    whether or not resume.from reads it (the config loader resolves resume.from through the link)."""
    d = _copy(steps_run, tmp_path)
    sdir = d / stepcapture.state_dir_name(3)
    link = sdir if what == "directory" else sdir / "trainer_state.json"
    outside = tmp_path / "outside" / link.name
    outside.parent.mkdir()
    shutil.move(link, outside)
    link.symlink_to(outside, target_is_directory=what == "directory")
    for resume in ([], ["--set", f"resume.from='{steps_run / stepcapture.state_dir_name(3)}'"]):
        assert main(["explain", str(d / STEP3), *resume]) == 2
        err = capsys.readouterr().err
        assert f"'{link.name}' is a symbolic link" in err and str(link) in err, err
    assert main(["replay", str(d / STEP3), "--out", str(tmp_path / "r")]) == 2
    assert "is a symbolic link" in capsys.readouterr().err and not (tmp_path / "r" / "replay_metrics.json").exists()


def test_a_missing_start_state_is_refused(steps_run: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A captured step keeps its start state next to its manifest, even when resume.from names a copy."""
    d = _copy(steps_run, tmp_path)
    shutil.rmtree(d / stepcapture.state_dir_name(3))
    assert main(["explain", str(d / STEP3), "--set",
                 f"resume.from='{steps_run / stepcapture.state_dir_name(3)}'"]) == 2
    err = capsys.readouterr().err
    assert "step 3's start state (manifest field `state.dir`) is missing" in err, err


def test_steps_before_the_resume_state_are_refused(steps_run: Path, workspace: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    state = steps_run / stepcapture.state_dir_name(3)  # a state of step 2: the run resumes at step 3
    assert main(["train", str(workspace / "train.toml"), "--out", str(tmp_path / "r"),
                 *sets("training.max_steps=5", "optimizer_batch.capture_steps=[1]", f"resume.from='{state}'")]) == 2
    err = capsys.readouterr().err
    assert "steps [1] come before the resume state's next step 3" in err and "Traceback" not in err
    assert not list((tmp_path / "r").glob("optimizer_batch_step_*"))


def test_a_user_trigger_writes_the_buffered_steps_and_memory_stays_bounded(tmp_path: Path) -> None:
    """RingCapture driven directly with a real optimizer on two small parameters (no model needed)."""
    from replayjob.producers.builtin.ring import RingCapture
    from replayjob.rl.batch import OptimizerBatch
    from replayjob.rl.hooks import TrainerView
    from replayjob.rl.update import UpdateResult

    params = {"a.lora_A.weight": torch.nn.Parameter(torch.ones(2, 3)),
              "a.lora_B.weight": torch.nn.Parameter(torch.zeros(3, 2))}
    opt = torch.optim.AdamW(list(params.values()), lr=1e-3, foreach=False)
    view = TrainerView(lambda: {k: p.detach() for k, p in params.items()}, opt, {"name": "toy"}, 0)
    cfg = load_config(None, ["optimizer_batch.ring_size=2"])
    hook = RingCapture.prepare(cfg, tmp_path, trigger=lambda step, r: "user says so" if step == 3 else None)
    hook.on_train_begin(view)
    m = torch.ones((1, 2), dtype=torch.float64)
    rows = OptimizerBatch.from_padded([[1, 2, 3]], [1], {k: m for k in
                                      ("old_logprobs", "ref_logprobs", "advantages", "loss_weights")}, m)
    peaks = []
    for step in range(5):
        hook.before_update(step, rows)
        for p in params.values():
            p.grad = torch.full_like(p, 0.1 * (step + 1))
        opt.step()
        hook.after_update(step, UpdateResult(loss=1.0, grad_norm=1.0))
        peaks.append(hook.peak_bytes)
    out = hook.finish({})["optimizer_batch/ring"]
    assert out["trigger"] == {"step": 3, "reason": "user says so"} and [w["step"] for w in out["written"]] == [2, 3]
    # step 0 starts with no optimizer state; from step 2 on two full slots are recycled: bounded
    assert peaks[0] < peaks[1] < peaks[2] == peaks[3] == peaks[4]
    assert out["steps_observed"] == 4  # the ring stops after its one write
    state = read_state(tmp_path / ring.RING_DIR / stepcapture.state_dir_name(3))
    assert state.step == 2 and state.has_optimizer
    written = {w["step"]: w for w in out["written"]}
    assert written[2]["final_adapter_sha256"] == written[3]["initial_adapter_sha256"]


@pytest.mark.parametrize(("edit", "field"), [
    (lambda e: e.update(manifest_sha256="xyz"), "manifest_sha256"),
    (lambda e: e.update(replay_config="../elsewhere.toml"), "replay_config"),
    (lambda e: e.update(step=-1), "step"),
    (lambda e: e.pop("nonfinite_inputs"), "nonfinite_inputs"),
    (lambda e: e.update(loss="low"), "loss"),
])
def test_read_steps_refuses_a_malformed_entry(steps_run: Path, tmp_path: Path, edit: Any, field: str) -> None:
    doc = metrics(steps_run)
    edit(doc["optimizer_batch/steps"][0])
    (tmp_path / "metrics.json").write_text(json.dumps(doc))
    with pytest.raises(IntegrityError) as info:
        read_steps(tmp_path)
    # the entry and its field named: `optimizer_batch/steps[0].FIELD`, or the entry lacks required field `FIELD`
    text = info.value.message
    assert f"`optimizer_batch/steps[0].{field}`" in text or (
        "`optimizer_batch/steps[0]`" in text and f"missing required field `{field}`" in text), text


def test_reduce_compares_replays_with_a_captured_step(steps_run: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``reduce --source RUN --source-step K``: the step's record is the source (its final adapter pinned by
    SHA-256 only); a step that was not captured, or the approximate claim, is refused."""
    replay_metrics(steps_run / STEP3, tmp_path / "r" / "same" / "repeat-000", "--set", "optimizer_batch.arm=same")
    out = tmp_path / "v.json"
    for claim in ("exact-input", "bitwise"):
        assert main(["reduce", str(tmp_path / "r"), "--claim", claim, "--source", str(steps_run),
                     "--source-step", "3", "--min-repeats", "1", "--out", str(out)]) == 0, capsys.readouterr()
        v = json.loads(out.read_text())
        checks = {c["name"]: c["status"] for c in v["checks"]}
        assert checks["exact.loss_same_condition"] == checks["inputs.capture_pins"] == "pass"
    assert main(["reduce", str(tmp_path / "r"), "--claim", "bitwise", "--source", str(steps_run),
                 "--min-repeats", "1", "--out", str(tmp_path / "whole.json")]) == 2  # the run's own pins: not step 3
    capsys.readouterr()
    assert main(["reduce", str(tmp_path / "r"), "--claim", "bitwise", "--source", str(steps_run),
                 "--source-step", "2", "--min-repeats", "1", "--out", str(tmp_path / "v2.json")]) == 2
    assert "step 2 is not a captured step" in capsys.readouterr().err
    assert main(["reduce", str(tmp_path / "r"), "--claim", "approximate", "--source", str(steps_run),
                 "--source-step", "3", "--tolerances", str(tmp_path / "t.toml"), "--min-repeats", "1",
                 "--out", str(tmp_path / "v3.json")]) == 2
    assert "keeps only its SHA-256" in capsys.readouterr().err
    tampered = tmp_path / "tampered"
    shutil.copytree(steps_run, tampered)
    manifest = tampered / "optimizer_batch_step_000003.manifest.json"
    manifest.write_bytes(manifest.read_bytes() + b" ")
    assert main(["reduce", str(tmp_path / "r"), "--claim", "bitwise", "--source", str(tampered),
                 "--source-step", "3", "--min-repeats", "1", "--out", str(tmp_path / "v4.json")]) == 2
    assert "step 3 record's manifest_sha256" in capsys.readouterr().err  # the pin the step's record holds
