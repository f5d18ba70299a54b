"""TRL integration: a real GRPOTrainer step captured, explained, replayed and reduced.

The scenario: a tiny Qwen2 built from a config and a character-level tokenizer built offline with
the ``tokenizers`` library, saved to a local directory; GRPOTrainer with LoRA (dropout 0.1),
beta 0.04, num_iterations 2, gradient accumulation 2, a reward with variance; capture at step 1.
One capture per session (``trl_capture``); refusals run in-process on copies of it.  Nothing is
downloaded (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest

pytest.importorskip("trl", reason="the TRL tests need the 'trl' extra: pip install -e '.[trl]'")
os.environ["HF_HUB_OFFLINE"] = "1"  # inherited by the replay subprocesses

import torch
from conftest import TRL_STEP as STEP
from conftest import grpo

from replayjob.cli import main
from replayjob.digest import sha256_bytes, sha256_json
from replayjob.jsonio import canonical_bytes
from replayjob.producers.api import capture as cap
from replayjob.producers.api import files as _files

pytestmark = pytest.mark.usefixtures("fresh_determinism_mode")

GC = ["--set", "trl.gradient_checkpointing=true",
      "--set", 'optimizer_batch.allow_config_differences=["trl.gradient_checkpointing"]']


def _metrics(d: Path, name: str = "metrics.json") -> dict[str, Any]:
    out: dict[str, Any] = json.loads((d / name).read_text())
    return out


def test_capture_writes_the_step_with_pins_and_a_ready_replay_toml(trl_capture: dict[str, Any]) -> None:
    d, res = trl_capture["dir"], trl_capture["result"]
    m = json.loads(res.manifest.read_text())
    assert m["step"] == STEP and m["framework"] == "trl"
    assert len(m["micro_batches"]) == 2  # gradient accumulation 2
    keys = set(m["micro_batches"][0]["inputs"]["tensors"])
    assert {"prompt_ids", "completion_ids", "completion_mask", "advantages", "old_per_token_logps",
            "ref_per_token_logps", "num_items_in_batch"} <= keys
    assert m["micro_batches"][0]["sync_gradients"] is False and m["micro_batches"][1]["sync_gradients"] is True
    assert m["optimizer"]["tensors"] and m["optimizer"]["scheduler"]["last_epoch"] == STEP  # K > 0: Adam moments
    assert set(m["config"]["resolved"]["stack"]) == set(_files.STACK)
    metrics = _metrics(d)
    log = [h for h in trl_capture["log"] if "grad_norm" in h]
    assert metrics["grad_norm"] == log[STEP]["grad_norm"]
    assert metrics["loss"] == log[STEP]["loss"]  # accumulated in float32 as transformers logs it (logging_steps=1)
    assert log[STEP]["step"] == STEP + 1  # step K is 0-based: TRL logs it as step K + 1
    assert metrics["optimizer_batch/manifest_sha256"] == res.manifest_sha256 == sha256_bytes(res.manifest.read_bytes())
    toml = res.replay_toml.read_text()
    assert res.manifest_sha256 in toml and res.logical_sha256 in toml
    assert main(["explain", str(res.replay_toml)]) == 0


def test_capture_does_not_change_training(trl_base: Path, trl_capture: dict[str, Any], tmp_path: Path) -> None:
    trainer, _ = grpo(trl_base, tmp_path)  # capture off
    on = [(h.get("loss"), h.get("grad_norm")) for h in trl_capture["log"]]
    off = [(h.get("loss"), h.get("grad_norm")) for h in trainer.state.log_history]
    assert on == off and len(on) == 4  # three steps and the summary, bitwise equal
    final = _files.trainable_parameters(trainer.model)
    assert set(final) == set(trl_capture["adapter"])
    assert all(torch.equal(final[n], t) for n, t in trl_capture["adapter"].items())


def test_same_condition_replay_is_bitwise_and_reads_no_dataset(trl_capture: dict[str, Any], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    import trl

    calls: list[str] = []

    def spy(cls: Any, name: str) -> None:
        orig = getattr(cls, name)

        def wrapped(*a: Any, **kw: Any) -> Any:
            calls.append(name)
            return orig(*a, **kw)
        monkeypatch.setattr(cls, name, wrapped)

    for name in ("_generate_and_score_completions", "_generate", "_calculate_rewards", "get_train_dataloader",
                 "_prepare_inputs"):
        spy(trl.GRPOTrainer, name)
    for name in ("__getitem__", "__iter__"):
        spy(datasets.Dataset, name)
    res = trl_capture["result"]
    assert main(["replay", str(res.replay_toml), "--out", str(tmp_path / "r")]) == 0
    assert calls == []  # no generation, reward, dataloader, dataset row or input preparation
    r, s = _metrics(tmp_path / "r", "replay_metrics.json"), _metrics(res.out_dir)
    assert r["optimizer_batch/final_adapter_sha256"] == s["optimizer_batch/final_adapter_sha256"]
    assert r["optimizer_batch/final_adapter_sha256"] != r["optimizer_batch/initial_adapter_sha256"]
    assert r["loss"] == s["loss"] and r["grad_norm"] == s["grad_norm"]
    assert r["optimizer/logical_batch_sha256"] == s["optimizer/logical_batch_sha256"]
    assert r["arm"] == "baseline" and r["skipped"] == ["dataset", "environment", "rollout", "sampling"]


def test_step_zero_replays_bitwise_from_an_empty_optimizer(trl_base: Path, tmp_path: Path) -> None:
    _, handle = grpo(trl_base, tmp_path / "cap", capture_step=0, max_steps=1)
    res = handle.result
    assert json.loads(res.manifest.read_text())["optimizer"]["tensors"] == {}  # no Adam state before step 0
    assert main(["replay", str(res.replay_toml), "--out", str(tmp_path / "r")]) == 0
    r, s = _metrics(tmp_path / "r", "replay_metrics.json"), _metrics(res.out_dir)
    assert r["optimizer_batch/final_adapter_sha256"] == s["optimizer_batch/final_adapter_sha256"]


def test_capture_refuses_a_base_model_not_in_a_local_directory(trl_base: Path, tmp_path: Path) -> None:
    from replayjob.producers.trl.producer import capture_optimizer_batch

    trainer, _ = grpo(trl_base, tmp_path, train=False)
    trainer.model.get_base_model().config._name_or_path = "Qwen/Qwen2-0.5B"  # as if loaded from the Hub
    with pytest.raises(cap.CaptureError, match="not loaded from a local directory"):
        capture_optimizer_batch(trainer, tmp_path / "cap", step=0)
    assert not (tmp_path / "cap").exists()


def _copy(trl_capture: dict[str, Any], tmp_path: Path) -> Path:
    d = tmp_path / "cap"
    shutil.copytree(trl_capture["dir"], d, ignore=shutil.ignore_patterns("trainer"))
    return d


def _flip(p: Path, offset: int = -3) -> None:
    data = bytearray(p.read_bytes())
    data[offset] ^= 0x01
    p.write_bytes(bytes(data))


def _explain(toml: Path, capsys: pytest.CaptureFixture[str], *sets: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["explain", str(toml), *sets])
    out = capsys.readouterr()
    return rc, out.out + out.err


def _pins(d: Path) -> list[str]:
    """Point the copied replay.toml at the copy (its manifest path is absolute)."""
    name = f"optimizer_batch_step_{STEP:06d}.manifest.json"
    return ["--set", f'optimizer_batch.replay_path="{d / name}"']


@pytest.mark.parametrize(("case", "cause"), [
    ("payload byte", "payload"),
    ("optimizer state", "optimizer state"),
    ("wrong pin", "wrong logical pin"),
    ("different base model", "different base model"),
    ("undeclared difference", "undeclared difference 'trl.gradient_checkpointing'"),
    ("undeclared math change", "optimizer contract differs from the source's at update.beta"),
])
def test_refusals_name_the_cause(case: str, cause: str, trl_capture: dict[str, Any], trl_base: Path,
                                 tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy(trl_capture, tmp_path)
    sets = _pins(d)
    stem = f"optimizer_batch_step_{STEP:06d}"
    if case == "payload byte":
        _flip(d / f"{stem}.safetensors")
    elif case == "optimizer state":
        _flip(d / f"{stem}.optimizer.safetensors")
    elif case == "wrong pin":
        sets += ["--set", f'optimizer_batch.expected_logical_sha256="{"0" * 64}"']
    elif case == "different base model":
        other = tmp_path / "other_base"
        shutil.copytree(trl_base, other)
        _flip(other / "model.safetensors")
        sets += ["--set", f'model.path="{other}"']
    elif case == "undeclared difference":
        sets += ["--set", "trl.gradient_checkpointing=true"]
    else:
        sets += ["--set", "trl.beta=0.1"]
    rc, text = _explain(d / "replay.toml", capsys, *sets)
    assert rc == 2, text
    assert cause in text and "Traceback" not in text
    assert main(["replay", str(d / "replay.toml"), "--out", str(tmp_path / "r"), *sets]) == 2
    assert not (tmp_path / "r" / "replay_metrics.json").exists()


def _as_other_trl_version(src: Path, d: Path, version: str) -> str:
    """The capture as a different TRL version would have recorded it: the manifest's stack entry changed, its
    embedded digest recomputed and metrics.json's manifest pin updated, so only the version differs.  (Another
    TRL cannot be installed offline.)"""
    name = f"optimizer_batch_step_{STEP:06d}.manifest.json"
    doc = json.loads((src / name).read_text())
    doc["config"]["resolved"]["stack"]["trl"] = version
    doc["config"]["sha256"] = sha256_json(doc["config"]["resolved"])
    data = canonical_bytes(doc) + b"\n"
    (d / name).write_bytes(data)
    metrics = _metrics(d)
    metrics["optimizer_batch/manifest_sha256"] = sha256_bytes(data)
    metrics["config"] = doc["config"]["resolved"]
    (d / "metrics.json").write_text(json.dumps(metrics))
    return sha256_bytes(data)


def test_trl_version_change_refused_unless_declared_then_approximate_only(
        trl_capture: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy(trl_capture, tmp_path)
    pin = _as_other_trl_version(trl_capture["dir"], d, "1.15.0")
    sets = [*_pins(d), "--set", f'optimizer_batch.expected_manifest_sha256="{pin}"']
    rc, text = _explain(d / "replay.toml", capsys, *sets)
    assert rc == 2 and "undeclared difference 'stack.trl'" in text and "1.15.0" in text, text
    tol = tmp_path / "tolerances.toml"
    tol.write_text("update_cosine_min = 0.99\nrelative_delta_l2_max = 0.1\n")
    declared = [*sets, "--set", 'optimizer_batch.allow_config_differences=["stack.trl"]',
                "--set", f'optimizer_batch.tolerances_sha256="{sha256_bytes(tol.read_bytes())}"']
    rc, text = _explain(d / "replay.toml", capsys, *declared)
    assert rc == 0, text
    assert main(["replay", str(d / "replay.toml"), "--out", str(tmp_path / "r" / "new-trl"), *declared]) == 0
    assert _metrics(tmp_path / "r" / "new-trl", "replay_metrics.json")["knobs"] == {"stack.trl": "1.16.0"}
    common = [str(tmp_path / "r"), "--source", str(d), "--min-repeats", "1"]
    # approximate: the verdict needs a same-condition arm (replays under the capture's own TRL), which this
    # environment cannot run, so exact.loss_same_condition cannot be made: it alone refuses the evidence (2),
    # and the update tolerances are then not evaluated
    assert main(["reduce", *common, "--claim", "approximate", "--tolerances", str(tol),
                 "--out", str(tmp_path / "approximate.json")]) == 2
    approx = {c["name"]: c for c in json.loads((tmp_path / "approximate.json").read_text())["checks"]}
    assert [k for k, c in approx.items() if c["status"] == "refused"] == ["exact.loss_same_condition"]
    assert "not evaluated" in approx["approximate.update_cosine"]["detail"]
    # exact-input (and bitwise) cannot judge a version difference: refused, naming the approximate claim
    assert main(["reduce", *common, "--claim", "exact-input", "--out", str(tmp_path / "exact.json")]) == 2
    checks = {c["name"]: c for c in json.loads((tmp_path / "exact.json").read_text())["checks"]}
    assert checks["exact.systems_only"]["status"] == "refused"
    assert "--claim approximate" in checks["exact.systems_only"]["detail"]


@pytest.mark.slow
def test_reduce_gates_pass_over_fresh_replays(trl_capture: dict[str, Any], tmp_path: Path) -> None:
    """2 fresh-process replays per arm (baseline, gradient checkpointing): exact-input and bitwise pass."""
    res = trl_capture["result"]
    reps = tmp_path / "replays"
    assert main(["replay", str(res.replay_toml), "--out", str(reps / "baseline"), "--repeat", "2"]) == 0
    assert main(["replay", str(res.replay_toml), "--out", str(reps / "ckpt"), "--repeat", "2", *GC]) == 0
    gc = _metrics(reps / "ckpt" / "repeat-000", "replay_metrics.json")
    assert gc["arm"] == "gradient_checkpointing=true" and gc["framework"] == "trl"
    # observed on the rebuilt TRL trainer: checkpointing on, transformers' non-reentrant default, the captured kernel
    attn = json.loads(res.manifest.read_text())["config"]["resolved"]["model"]["attn_implementation"]
    assert gc["runtime"] == {"trl.gradient_checkpointing": True, "model.attn_implementation": attn,
                             "trl.gradient_checkpointing_kwargs.use_reentrant": False,
                             "trl.per_device_train_batch_size": 4, "distributed.num_processes": 1,
                             "trl.gradient_accumulation_steps": 2, "trl.steps_per_generation": 2,
                             "model.routing": "free"}  # a dense model routes nothing
    base = _metrics(reps / "baseline" / "repeat-000", "replay_metrics.json")
    assert base["runtime"]["trl.gradient_checkpointing"] is False
    assert base["runtime"]["trl.gradient_checkpointing_kwargs.use_reentrant"] is None  # no checkpoint function
    common = ["--source", str(res.out_dir), "--baseline", "baseline", "--min-repeats", "2"]
    assert main(["reduce", str(reps), "--claim", "exact-input", "--arms", "baseline,gradient_checkpointing=true",
                 "--out", str(tmp_path / "exact.json"), *common]) == 0
    assert main(["reduce", str(reps / "baseline"), "--claim", "bitwise", "--arms", "baseline",
                 "--out", str(tmp_path / "bitwise.json"), *common]) == 0


# -- several chosen steps of one run -----------------------------------------------------------------

@pytest.fixture(scope="module")
def trl_steps(trl_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """max_steps 5 with steps 3, 1 and 4 chosen (unsorted); an early stop after step 3, so step 4 never runs."""
    from transformers import TrainerCallback

    class StopAfterStep3(TrainerCallback):  # a real early stop (as EarlyStoppingCallback does it)
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 4:
                control.should_training_stop = True

    out = tmp_path_factory.mktemp("trl_steps")
    trainer, handle = grpo(trl_base, out, capture_steps=[3, 1, 4], max_steps=5, callbacks=[StopAfterStep3()])
    return {"dir": out, "result": handle.steps_result, "log": trainer.state.log_history}


def test_several_steps_write_per_step_files_and_one_metrics(trl_steps: dict[str, Any]) -> None:
    from replayjob.artifacts.metrics import read_steps

    d, res = trl_steps["dir"], trl_steps["result"]
    assert sorted(res.captured) == [1, 3] and res.not_captured == (4,)
    with pytest.raises(cap.CaptureError, match=r"step 4 was not captured \(training ended"):
        res.step(4)
    pins = read_steps(d)  # the record the built-in trainer's capture_steps writes
    assert [p.step for p in pins] == [1, 3]
    doc = _metrics(d)
    assert doc["framework"] == "trl" and doc["optimizer_batch/steps_not_captured"] == [4]
    log = [h for h in trl_steps["log"] if "grad_norm" in h]
    for p in pins:
        stem = f"optimizer_batch_step_{p.step:06d}"
        for suffix in (".safetensors", ".adapter.safetensors", ".optimizer.safetensors", ".manifest.json"):
            assert (d / f"{stem}{suffix}").is_file()
        assert p.replay_config == d / f"replay_step_{p.step:06d}.toml"
        assert p.manifest_path == d / f"{stem}.manifest.json"
        assert p.manifest == sha256_bytes(p.manifest_path.read_bytes()) == res.step(p.step).manifest_sha256
        assert p.grad_norm == log[p.step]["grad_norm"] and p.nonfinite_inputs is False
        m = json.loads(p.manifest_path.read_text())
        assert m["step"] == p.step and m["optimizer"]["scheduler"]["last_epoch"] == p.step
        logprobs = {"micro_step": 2 * p.step, "generate_every": 4, "sources": {"old_per_token_logps": "trainer_old"}}
        precision = m["framework_state"]["precision"]  # each chosen step records its own (float32 here)
        assert (precision["compute_dtype"], precision["autocast"]["enabled"]) == ("float32", False)
        assert m["framework_state"] == {"global_step": p.step, "max_steps": 5, "logprobs": logprobs,
                                        "precision": precision, "launch": {"requested_processes": None,
                                                                           "processes": 1}}
        assert len(m["micro_batches"]) == 2
        assert m["files"]["adapter"]["sha256"] == p.initial_adapter != p.final_adapter
    assert pins[0].final_adapter != pins[1].initial_adapter  # step 2 ran between them
    assert not (d / "replay.toml").exists() and not (d / "final_adapter").exists()
    assert not list(d.glob("optimizer_batch_step_000004*")) and not (d / "replay_step_000004.toml").exists()


def test_each_chosen_step_replays_bitwise(trl_steps: dict[str, Any], tmp_path: Path) -> None:
    from replayjob.artifacts.metrics import read_steps

    for p in read_steps(trl_steps["dir"]):
        assert main(["explain", str(p.replay_config)]) == 0
        assert main(["replay", str(p.replay_config), "--out", str(tmp_path / str(p.step))]) == 0
        r = _metrics(tmp_path / str(p.step), "replay_metrics.json")
        assert r["step"] == p.step and r["optimizer_batch/manifest_sha256"] == p.manifest
        assert r["optimizer_batch/initial_adapter_sha256"] == p.initial_adapter
        assert r["optimizer_batch/final_adapter_sha256"] == p.final_adapter  # TRL's real update of that step
        assert r["loss"] == p.loss and r["grad_norm"] == p.grad_norm


def test_a_step_replay_handed_another_steps_pins_is_refused(trl_steps: dict[str, Any], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from replayjob.artifacts.metrics import read_steps

    one, three = read_steps(trl_steps["dir"])
    wrong = [["--set", f'optimizer_batch.expected_manifest_sha256="{one.manifest}"'],
             ["--set", f'optimizer_batch.replay_path="{one.manifest_path}"']]  # step 1's manifest, step 3's pins
    for sets in wrong:
        rc, text = _explain(three.replay_config, capsys, *sets)
        assert rc == 2 and "Traceback" not in text, text
        assert main(["replay", str(three.replay_config), "--out", str(tmp_path / "r"), *sets]) == 2
        assert not (tmp_path / "r" / "replay_metrics.json").exists()


def test_capture_arguments_are_checked_before_training(trl_base: Path, trl_capture: dict[str, Any],
                                                       tmp_path: Path) -> None:
    from replayjob.errors import ArtifactExistsError, UsageError
    from replayjob.producers.trl.producer import capture_optimizer_batch

    trainer, _ = grpo(trl_base, tmp_path, train=False)
    out = tmp_path / "cap"
    for kwargs, cause in [({"step": 1, "steps": [1]}, "not both"),
                          ({"steps": [1, 1]}, r"steps \[1\] are listed more than once"),
                          ({"steps": [-1, 2]}, "integers >= 0"), ({"steps": []}, "integers >= 0"),
                          ({"step": -1}, "integer >= 0")]:
        with pytest.raises(UsageError, match=cause) as exc:
            capture_optimizer_batch(trainer, out, **kwargs)
        assert exc.value.exit_code == 2
    assert capture_optimizer_batch(trainer, out).step == 0  # neither: the first step, as before steps=
    with pytest.raises(cap.CaptureError, match=r"step\(s\) \[3\] are not reached"):
        capture_optimizer_batch(trainer, out, steps=[1, 3])  # max_steps 3: steps 0, 1, 2
    with pytest.raises(ArtifactExistsError):  # a directory already holding step 1's capture, either layout
        capture_optimizer_batch(trainer, trl_capture["dir"], steps=[0, 1])
    with pytest.raises(ArtifactExistsError):
        capture_optimizer_batch(trainer, trl_capture["dir"], step=1)
    assert not out.exists()


# -- knob names ---------------------------------------------------------------------------------------

def test_checkpointing_under_either_name_and_reentrant_only_with_checkpointing(
        trl_capture: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """transformers' current ``activation_checkpointing`` and its deprecated twin ``gradient_checkpointing`` name
    one setting: an override under either name takes effect (observed on the rebuilt model) and is compared under
    the old name; ``use_reentrant`` without checkpointing runs no checkpoint function: not present, refused."""
    toml = trl_capture["result"].replay_toml
    new = ["--set", "trl.activation_checkpointing=true",
           "--set", 'optimizer_batch.allow_config_differences=["trl.activation_checkpointing"]']
    rc, text = _explain(toml, capsys, *new)
    assert rc == 0, text
    assert main(["replay", str(toml), "--out", str(tmp_path / "new"), *new]) == 0
    r = _metrics(tmp_path / "new", "replay_metrics.json")
    assert r["arm"] == "gradient_checkpointing=true" and r["runtime"]["trl.gradient_checkpointing"] is True
    assert r["allowed_config_differences"] == ["trl.gradient_checkpointing"]
    kwargs = ["--set", "trl.activation_checkpointing_kwargs={use_reentrant=true}", *new[:2],
              "--set", 'optimizer_batch.allow_config_differences=["trl.activation_checkpointing",'
                       '"trl.activation_checkpointing_kwargs.use_reentrant"]']
    rc, text = _explain(toml, capsys, *kwargs)
    assert rc == 0, text
    both = ["--set", "trl.activation_checkpointing=true", "--set", "trl.gradient_checkpointing=false",
            "--set", 'optimizer_batch.allow_config_differences=["trl.gradient_checkpointing"]']
    rc, text = _explain(toml, capsys, *both)
    assert rc == 2 and "name one transformers setting" in text, text
    for name in ("gradient", "activation"):
        alone = ["--set", f"trl.{name}_checkpointing_kwargs={{use_reentrant=true}}",
                 "--set", f'optimizer_batch.allow_config_differences=["trl.{name}_checkpointing_kwargs.use_reentrant"]']
        rc, text = _explain(toml, capsys, *alone)
        assert rc == 2 and "'trl.gradient_checkpointing_kwargs.use_reentrant' is not present" in text, text
        assert main(["replay", str(toml), "--out", str(tmp_path / name), *alone]) == 2


@pytest.mark.parametrize(("edit", "named"), [
    (lambda d: d["framework_state"].update(max_steps="3"), "framework_state.max_steps is '3', not an integer above"),
    (lambda d: d["framework_state"].update(max_steps=STEP), f"not an integer above the captured step {STEP}"),
    (lambda d: d["framework_state"].pop("max_steps"), "framework_state.max_steps is None"),
])
def test_a_framework_state_the_trainer_cannot_be_rebuilt_from_is_refused_by_explain(
        edit: Any, named: str, trl_capture: dict[str, Any], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The replay rebuilds the trainer's LR schedule from framework_state.max_steps (int(), at replay): a re-pinned
    manifest whose max_steps is a string, missing or not beyond the step was admitted, and the replay failed with
    exit 3 (ValueError, KeyError) or built another schedule."""
    d = _copy(trl_capture, tmp_path)
    name = f"optimizer_batch_step_{STEP:06d}.manifest.json"
    doc = json.loads((d / name).read_text())
    edit(doc)
    data = canonical_bytes(doc) + b"\n"
    (d / name).write_bytes(data)
    rc, text = _explain(d / "replay.toml", capsys, *_pins(d),
                        "--set", f'optimizer_batch.expected_manifest_sha256="{sha256_bytes(data)}"')
    assert rc == 2 and named in text and "Traceback" not in text, text


# -- arms proven against the baseline's update (dropout 0) ----------------------------------------------

def _rewritten(res: Any, d: Path, **trl: Any) -> list[str]:
    """A copy of the capture whose manifest records other GRPOConfig values (``trl``), its config and contract
    digests recomputed; the ``--set`` pins of a replay of the copy.  Its replays are compared with each other,
    never with the source's recorded update (which ran the original values)."""
    shutil.copytree(res.out_dir, d, ignore=shutil.ignore_patterns("trainer"))
    name = res.manifest.name
    doc = json.loads((d / name).read_text())
    doc["config"]["resolved"]["trl"].update(trl)
    doc["config"]["sha256"] = sha256_json(doc["config"]["resolved"])
    doc["contract"]["value"]["update"].update({k: v for k, v in trl.items() if k in doc["contract"]["value"]["update"]})
    doc["contract"]["sha256"] = sha256_json(doc["contract"]["value"])
    data = canonical_bytes(doc) + b"\n"
    (d / name).write_bytes(data)
    return ["--set", f'optimizer_batch.replay_path="{d / name}"',
            "--set", f'optimizer_batch.expected_manifest_sha256="{sha256_bytes(data)}"']


def _update(d: Path, initial: dict[str, torch.Tensor]) -> torch.Tensor:
    from safetensors.torch import load_file

    final = load_file(str(d / _files.FINAL_ADAPTER_FILE))
    return torch.cat([(final[n].double() - initial[n].double()).reshape(-1) for n in sorted(initial)])


def _against_baseline(base: Path, arm: Path, initial: dict[str, torch.Tensor]) -> dict[str, float]:
    """The arm's update against the baseline's: cosine and relative L2 distance of the adapter updates, and the
    differences of the reported loss (absolute) and pre-clip gradient norm (relative)."""
    a, b = _update(arm, initial), _update(base, initial)
    ra, rb = _metrics(arm, "replay_metrics.json"), _metrics(base, "replay_metrics.json")
    return {"cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
            "relative_delta_l2": float((a - b).norm() / b.norm()),
            "loss": abs(ra["loss"] - rb["loss"]),  # absolute: a GRPO loss of O(1) terms cancels to ~0
            "grad_norm": abs(ra["grad_norm"] - rb["grad_norm"]) / rb["grad_norm"]}


def _equal_within_fp(c: dict[str, float]) -> bool:
    return c["cosine"] >= 1 - 1e-6 and c["relative_delta_l2"] <= 1e-4 and c["loss"] <= 1e-6 and c["grad_norm"] <= 1e-5




def _arm(*sets: str, knobs: list[str]) -> list[str]:
    out = []
    for s in sets:
        out += ["--set", s]
    return [*out, "--set", "optimizer_batch.allow_config_differences=" + json.dumps(knobs)]


GRPO_ARMS = {
    "checkpointing": _arm("trl.gradient_checkpointing=true", knobs=["trl.gradient_checkpointing"]),
    "reentrant": _arm("trl.gradient_checkpointing=true", "trl.gradient_checkpointing_kwargs={use_reentrant=true}",
                      knobs=["trl.gradient_checkpointing", "trl.gradient_checkpointing_kwargs.use_reentrant"]),
    "sdpa": _arm('model.attn_implementation="sdpa"', knobs=["model.attn_implementation"]),
    "micro2": _arm("trl.per_device_train_batch_size=2", knobs=["trl.per_device_train_batch_size"]),
    "micro8": _arm("trl.per_device_train_batch_size=8", knobs=["trl.per_device_train_batch_size"]),
}


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "sapo", "luspo", "dapo"])
def test_each_admitted_knob_updates_as_the_baseline(loss_type: str, trl_capture_nodrop: dict[str, Any],
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """exact-input does not compare an arm's update with the baseline's, so each admitted TRL knob is proven here:
    the arm's adapter update equals the baseline replay's within floating-point tolerance, on the dropout-0
    capture (grpo as captured; the other loss types on a copy recording them).  A re-split that keeps the
    captured accumulation steps, i.e. a wrong normaliser (grpo's, and dapo's ratio), fails the same comparison."""
    from safetensors.torch import load_file

    from replayjob.producers.trl import producer as trl_mod

    res = trl_capture_nodrop["result"]
    sets = [] if loss_type == "grpo" else _rewritten(res, tmp_path / "cap", loss_type=loss_type)
    toml = res.replay_toml
    initial = load_file(str(res.manifest.with_name(res.manifest.name.replace(".manifest.json",
                                                                             ".adapter.safetensors"))))
    assert main(["replay", str(toml), "--out", str(tmp_path / "baseline"), *sets]) == 0
    if loss_type == "grpo":  # the capture's loss is the one TRL logged at that step (float32 accumulation)
        assert _metrics(res.out_dir)["loss"] == trl_capture_nodrop["log"][2]["loss"]
    arms = GRPO_ARMS if loss_type == "grpo" else {"micro2": GRPO_ARMS["micro2"]}
    for arm, arm_sets in arms.items():
        assert main(["replay", str(toml), "--out", str(tmp_path / arm), *sets, *arm_sets]) == 0, arm
        c = _against_baseline(tmp_path / "baseline", tmp_path / arm, initial)
        assert _equal_within_fp(c), (arm, c)
    r = _metrics(tmp_path / "micro2", "replay_metrics.json")
    assert r["runtime"]["trl.per_device_train_batch_size"] == 2  # the micro-batch size the update ran
    assert r["arm"] == "per_device_train_batch_size=2"
    if loss_type not in ("grpo", "dapo"):
        return
    geometry = trl_mod.resplit_geometry

    def wrong(source: dict[str, Any], replay: dict[str, Any], rows: int) -> dict[str, int]:
        # the captured accumulation steps: grpo divides each micro-batch by 2 instead of 4, and dapo's ratio
        # current_gradient_accumulation_steps / steps_per_generation is 2/4 instead of the captured 2/2
        return {**geometry(source, replay, rows),
                "gradient_accumulation_steps": int(source["gradient_accumulation_steps"])}

    monkeypatch.setattr(trl_mod, "resplit_geometry", wrong)
    assert main(["replay", str(toml), "--out", str(tmp_path / "planted"), *sets, *GRPO_ARMS["micro2"]]) == 0
    c = _against_baseline(tmp_path / "baseline", tmp_path / "planted", initial)
    assert not _equal_within_fp(c), c


def test_micro_batch_arm_refused_where_a_re_split_is_not_exact(
        trl_capture: dict[str, Any], trl_capture_nodrop: dict[str, Any], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    micro = GRPO_ARMS["micro2"]
    res = trl_capture_nodrop["result"]
    cases = [
        (trl_capture["result"].replay_toml, micro, "dropout draws one random mask per micro-batch"),  # LoRA dropout
        (res.replay_toml, [*_rewritten(res, tmp_path / "bnpo", loss_type="bnpo"), *micro],
         "bnpo divides each micro-batch's loss by that micro-batch's own token count"),
        (res.replay_toml, _arm("trl.per_device_train_batch_size=3", knobs=["trl.per_device_train_batch_size"]),
         "3 does not divide the step's 8 rows"),
        (res.replay_toml, [*_rewritten(res, tmp_path / "entropy", entropy_coef=0.01), *micro], "entropy bonus"),
    ]
    for toml, sets, cause in cases:
        rc, text = _explain(toml, capsys, *sets)
        assert rc == 2 and cause in text and "Traceback" not in text, text
    assert main(["replay", str(cases[1][0]), "--out", str(tmp_path / "r"), *cases[1][1]]) == 2
    assert not (tmp_path / "r" / "replay_metrics.json").exists()


# -- vLLM generation -------------------------------------------------------------------------------------

class FakeVLLMGeneration:
    """Stands in for ``trl.generation.vllm_generation.VLLMGeneration`` (no vLLM on CPU): built with the same
    keyword arguments, ``sync_weights()`` does nothing, and ``generate`` returns what vLLM's does, per prompt
    (prompt ids, completion ids, the sampled tokens' logprobs as ``[[lp], ...]`` and their token ids), with
    completions of varied length and made-up sampler logprobs: most sequences near the trainer's own logprobs
    (importance ratios different from 1), every fourth far below them (ratio above the clip: masked)."""

    built: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, **kwargs: Any) -> None:
        FakeVLLMGeneration.built.append(kwargs)
        self.max_completion_length = int(kwargs["max_completion_length"])
        self.calls = 0

    def sync_weights(self) -> None:
        pass

    def generate(self, prompts: list[list[int]], images: Any, num_generations: int, profiler: Any = None) -> tuple:
        g = torch.Generator().manual_seed(1000 + self.calls)
        self.calls += 1
        completions, logprobs, token_ids = [], [], []
        for i, _ in enumerate(prompts):
            n = 2 + (i + self.calls) % (self.max_completion_length - 1)
            ids = torch.randint(2, 97, (n,), generator=g).tolist()
            lp = -6.5 if i % 4 == 0 else -4.5 - 0.05 * (i % 3)
            completions.append(ids)
            logprobs.append([[lp] for _ in ids])
            token_ids.append([[t] for t in ids])
        return [list(p) for p in prompts], completions, logprobs, token_ids


def test_vllm_generated_step_replays_bitwise_with_the_sampler_correction(
        trl_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A run generating with vLLM (``use_vllm``, here TRL's vLLM generation class patched to return completions and
    sampler logprobs as it does) and TRL's importance-sampling correction (sequence_mask, clip_max 3): the replay
    builds the trainer without vLLM, applies the captured ratios as the source did and is bitwise; a replay
    that dropped the correction is not."""
    import trl.trainer.grpo_trainer as grpo_trainer

    from replayjob.producers.trl import producer as trl_mod

    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", FakeVLLMGeneration)
    _, handle = grpo(trl_base, tmp_path / "cap", capture_step=1, max_steps=2, use_vllm=True,
                     vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=3.0)
    assert len(FakeVLLMGeneration.built) == 1
    res = handle.result
    m = json.loads(res.manifest.read_text())
    assert {"importance_sampling_ratio", "sampling_per_token_logps", "old_per_token_logps"} <= set(
        m["micro_batches"][0]["inputs"]["tensors"])
    update = m["contract"]["value"]["update"]
    assert update["use_vllm"] is True and update["vllm_importance_sampling_mode"] == "sequence_mask"
    from safetensors.torch import load_file

    payload = load_file(str(res.out_dir / m["files"]["payload"]["file"]))
    ratios = torch.cat([t.reshape(-1) for k, t in payload.items() if k.endswith(".importance_sampling_ratio")])
    assert bool((ratios == 0).any()) and bool(((ratios != 0) & (ratios != 1)).any())  # masked, and corrected

    def no_vllm(**kwargs: Any) -> Any:
        raise AssertionError("the replay started vLLM")

    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", no_vllm)
    assert main(["replay", str(res.replay_toml), "--out", str(tmp_path / "r")]) == 0
    r, s = _metrics(tmp_path / "r", "replay_metrics.json"), _metrics(res.out_dir)
    assert r["optimizer_batch/final_adapter_sha256"] == s["optimizer_batch/final_adapter_sha256"]
    assert r["loss"] == s["loss"] and r["grad_norm"] == s["grad_norm"]
    for key, value in (("vllm_importance_sampling_clip_max", "2.0"), ("use_vllm", "false")):
        rc, text = _explain(res.replay_toml, capsys, "--set", f"trl.{key}={value}")
        assert rc == 2 and f"optimizer contract differs from the source's at update.{key}" in text, text
    monkeypatch.setattr(trl_mod, "_sampler_correction", lambda trainer, values: None)  # the correction dropped
    assert main(["replay", str(res.replay_toml), "--out", str(tmp_path / "dropped")]) == 0
    dropped = _metrics(tmp_path / "dropped", "replay_metrics.json")
    assert dropped["optimizer_batch/final_adapter_sha256"] != s["optimizer_batch/final_adapter_sha256"]


# -- RLOOTrainer ----------------------------------------------------------------------------------------

def test_rloo_step_replays_bitwise(trl_base: Path, tmp_path: Path) -> None:
    """RLOOTrainer through the same producer: its loss is a per-sequence mean and the transformers loop divides it
    by the accumulation steps; step 1 is captured (loss as logged), then replayed bitwise."""
    from conftest import reward
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import RLOOConfig, RLOOTrainer

    from replayjob.producers.trl.producer import capture_optimizer_batch

    model = AutoModelForCausalLM.from_pretrained(trl_base, dtype=torch.float32, attn_implementation="eager")
    args = RLOOConfig(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=4, num_generations=4,
                      gradient_accumulation_steps=2, num_iterations=2, beta=0.04, max_completion_length=6,
                      max_steps=2, logging_steps=1, report_to=[], use_cpu=True, seed=7, save_strategy="no",
                      learning_rate=1e-2, bf16=False, disable_tqdm=True)
    trainer = RLOOTrainer(model=model, reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(16)]}),
                          processing_class=AutoTokenizer.from_pretrained(trl_base),
                          peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "v_proj"]))
    handle = capture_optimizer_batch(trainer, tmp_path / "cap", step=1)
    trainer.train()
    res = handle.result
    m = json.loads(res.manifest.read_text())
    assert m["contract"]["value"]["update"]["trainer"] == "RLOOTrainer" and len(m["micro_batches"]) == 2
    s = _metrics(res.out_dir)
    log = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert s["loss"] == log[1]["loss"] and s["grad_norm"] == log[1]["grad_norm"]
    assert main(["replay", str(res.replay_toml), "--out", str(tmp_path / "r")]) == 0
    r = _metrics(tmp_path / "r", "replay_metrics.json")
    assert r["optimizer_batch/final_adapter_sha256"] == s["optimizer_batch/final_adapter_sha256"]
    assert r["optimizer_batch/final_adapter_sha256"] != r["optimizer_batch/initial_adapter_sha256"]
    assert r["loss"] == s["loss"] and r["grad_norm"] == s["grad_norm"]


def test_traced_replays_key_rows_alike_and_compare_the_checkpointing_arm_module_by_module(
        trl_capture: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from replayjob.artifacts.trace_store import read_trace

    toml = str(trl_capture["result"].replay_toml)
    runs = {name: tmp_path / name for name in ("a", "b", "gc")}
    for name, extra in (("a", []), ("b", ["--repeat-index", "1"]), ("gc", GC)):
        assert main(["replay", toml, "--out", str(runs[name]), "--trace", *extra]) == 0
    t = read_trace(runs["a"])
    m = _metrics(runs["a"], "replay_metrics.json")
    assert t.identity["logical_batch_sha256"] == m["optimizer/logical_batch_sha256"]
    assert t.identity["gradient_checkpointing"] is False and t.identity["micro_batch_size"] == m["rows"]["rows"] // 2
    # rows keyed by the producer's token mask: prompt and completion tokens that are real, each row once
    assert int(t.row_tokens.sum()) == t.forward[0].values.shape[0] == m["padding"]["real_tokens"]
    assert {p.name.rsplit(".", 3)[-3] for p in t.params} == {"lora_A", "lora_B"}
    # tracing leaves the update unchanged
    src = _metrics(trl_capture["dir"])
    assert m["optimizer_batch/final_adapter_sha256"] == src["optimizer_batch/final_adapter_sha256"]
    capsys.readouterr()
    assert main(["trace-diff", str(runs["a"]), str(runs["b"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["identical"] is True
    rc = main(["trace-diff", str(runs["a"]), str(runs["gc"]), "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc in (0, 1) and rep["classification"] in ("equal", "noise") and rep["b"]["gradient_checkpointing"] is True
    assert not [n for n in rep["unmatched"]["only_b"] if n.startswith("forward:")]
    assert len(rep["forward"]) == len(t.forward) and len(rep["backward"]) > 10


def test_in_process_repeats_reproduce_the_fresh_update(trl_capture: dict[str, Any], tmp_path: Path) -> None:
    res = trl_capture["result"]
    assert main(["replay", str(res.replay_toml), "--out", str(tmp_path / "w"),
                 "--set", "optimizer_batch.warmup_updates=1", "--set", "optimizer_batch.measured_updates=2"]) == 0
    r = _metrics(tmp_path / "w", "replay_metrics.json")
    ip = r["in_process"]
    assert ip["warmup_updates"] == 1 and ip["measured_updates"] == 2 and ip["loss_equal"] is True
    assert len(ip["local_train_wall_s"]) == 2
    # the saved adapter is the fresh update's, equal to the source's
    assert r["optimizer_batch/final_adapter_sha256"] == _metrics(res.out_dir)["optimizer_batch/final_adapter_sha256"]
