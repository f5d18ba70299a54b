"""Hostile start states and captures that hold together by their own digests: a forger who rewrites a captured
step's state files, re-pins them in ``trainer_state.json`` and the manifest and passes the new manifest pin.  Each
is refused with exit 2 and one message by explain and by replay alike (never admitted by one and refused, or
failed with exit 3, by the other), before any model is built."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from replayjob import tensorfile
from replayjob.cli import main
from replayjob.digest import sha256_bytes, sha256_json
from replayjob.errors import IntegrityError
from replayjob.jsonio import canonical_bytes
from replayjob.rl.state import (
    ADAPTER_WEIGHTS,
    OPTIMIZER_FILE,
    STATE_FILE,
    adapter_bytes,
    optimizer_bytes_of,
    read_state,
    write_state,
)

Tensors = dict[str, torch.Tensor]
K = 2
STATE_DIR = f"optimizer_batch_step_{K:06d}.state"
MANIFEST = f"optimizer_batch_step_{K:06d}.manifest.json"
CONFIG = f"replay_step_{K:06d}.toml"


@pytest.fixture(scope="module")
def step_run(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A four-step run of the built-in trainer capturing step 2 (shared: copy before modifying)."""
    out = tmp_path_factory.mktemp("r4") / "run"
    small = ["algorithm.prompts_per_step=2", "algorithm.group_size=4", "inference.max_new_tokens=4",
             "training.max_steps=3", f"optimizer_batch.capture_steps=[{K}]"]
    assert main(["train", str(workspace / "train.toml"), "--out", str(out),
                 *[x for s in small for x in ("--set", s)]]) == 0
    return out


def _resealed(step_run: Path, tmp_path: Path, optimizer: Callable[[Tensors], Tensors] | None = None,
              manifest: Callable[[dict[str, Any]], None] | None = None) -> tuple[Path, str]:
    """A copy of the capture with its optimizer file rewritten by ``optimizer`` and ``manifest`` applied, every
    inner digest recomputed (trainer_state.json, the manifest's state pin, config and contract digests); returns
    the copy and its new manifest pin."""
    run = tmp_path / "run"
    shutil.copytree(step_run, run)
    sd = run / STATE_DIR
    doc = json.loads((run / MANIFEST).read_text())
    if optimizer is not None:
        opt = optimizer(tensorfile.load(sd / OPTIMIZER_FILE))
        (sd / OPTIMIZER_FILE).unlink()
        st = json.loads((sd / STATE_FILE).read_text())
        files = write_state(sd, st["step"], st["model"], {OPTIMIZER_FILE: optimizer_bytes_of(opt)})
        doc["state"]["optimizer_sha256"] = files[OPTIMIZER_FILE]
    if manifest is not None:
        manifest(doc)
    doc["config"]["sha256"] = sha256_json(doc["config"]["resolved"])
    data = canonical_bytes(doc) + b"\n"
    (run / MANIFEST).write_bytes(data)
    return run, sha256_bytes(data)


def _explain_and_replay(run: Path, pin: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """explain and replay of the re-pinned capture: the exit status of each and what it printed."""
    cfg = run / CONFIG
    pins = ["--set", f'optimizer_batch.expected_manifest_sha256="{pin}"']
    out = []
    for cmd in (["explain", str(cfg)], ["replay", str(cfg), "--out", str(run / "replay")]):
        capsys.readouterr()
        code = main([*cmd, *pins])
        text = capsys.readouterr()
        out.append(f"{code}|{text.out}{text.err}")
    return out


def _with(**tensors: Callable[[Tensors], torch.Tensor]) -> Callable[[Tensors], Tensors]:
    def edit(t: Tensors) -> Tensors:
        return {**t, **{k.replace("__", "."): f(t) for k, f in tensors.items()}}
    return edit


def _without(*names: str) -> Callable[[Tensors], Tensors]:
    return lambda t: {k: v for k, v in t.items() if k not in names}


@pytest.mark.parametrize(("edit", "named"), [
    (_with(garbage=lambda t: torch.zeros(1)), "tensor 'garbage' is not AdamW state"),
    (_with(state__0__foo=lambda t: torch.zeros(1)), "tensor 'state.0.foo' is not AdamW state"),
    (_with(state__99__exp_avg=lambda t: torch.zeros(2)), "is the state of parameter 99, but the adapter has 16"),
    (_without("state.0.exp_avg_sq"), "parameter 0 holds AdamW state without exp_avg_sq"),
    (_with(state__0__exp_avg=lambda t: torch.zeros(3)), "state.0.exp_avg [3] and state.0.exp_avg_sq [8, 64] differ"),
    (_with(state__0__exp_avg=lambda t: t["state.0.exp_avg"].double()), "state.0.exp_avg is torch.float64, the "
                                                                       "adapter's parameters are torch.float32"),
    (_with(state__0__exp_avg=lambda t: torch.zeros(8, 64, dtype=torch.bool)), "state.0.exp_avg is torch.bool"),
    (_with(state__0__step=lambda t: torch.tensor(2)), "state.0.step is torch.int64[], not AdamW's floating scalar"),
    (_with(state__none=lambda t: torch.zeros(0)), "state.none (an optimizer without state) stands beside"),
    (_with(**{f"state__{i}__{k}": (lambda t, k=k: t[f"state.0.{k}"]) for i in range(16)
              for k in ("exp_avg", "exp_avg_sq", "step")}), "which no adapter parameter left has"),
    (_with(**{"0__exp_avg": lambda t: t["state.0.exp_avg"]}), "parameter 0's exp_avg is in the file twice"),
])
def test_a_resealed_optimizer_file_that_cannot_be_the_adapters_adamw_state_is_refused_by_explain_and_replay(
        edit: Callable[[Tensors], Tensors], named: str, step_run: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # explain admitted each of these; replay then refused (exit 2), failed in the optimizer's first step (exit 3:
    # a parameter without exp_avg_sq; a name that is no state.<i>.<key>) or replayed it (a moment cast to the
    # parameter's dtype, an integer step count)
    run, pin = _resealed(step_run, tmp_path, optimizer=edit)
    for out in _explain_and_replay(run, pin, capsys):
        assert out.startswith("2|") and named in out and "Traceback" not in out, out


def test_a_resumed_state_whose_optimizer_does_not_fit_its_adapter_is_refused_when_read(step_run: Path,
                                                                                        tmp_path: Path) -> None:
    # the rule is read_state's: capture, training and admission read every resume state through it
    d = tmp_path / "state"
    shutil.copytree(step_run / STATE_DIR, d)
    opt = tensorfile.load(d / OPTIMIZER_FILE)
    opt["state.1.exp_avg_sq"] = opt["state.1.exp_avg_sq"].T.contiguous()
    st = json.loads((d / STATE_FILE).read_text())
    write_state(d, st["step"], st["model"], {OPTIMIZER_FILE: optimizer_bytes_of(opt)})
    with pytest.raises(IntegrityError) as exc:
        read_state(d)
    assert "state.1.exp_avg [64, 8] and state.1.exp_avg_sq [8, 64] differ in shape" in exc.value.message
    # the state as written, in the names written before the shared ones, and without a parameter's state (an
    # expert's adapter no token reached is never stepped) are read
    shutil.rmtree(d)
    shutil.copytree(step_run / STATE_DIR, d)
    assert read_state(d).step == K - 1
    written = tensorfile.load(d / OPTIMIZER_FILE)
    for edit in ({k.removeprefix("state."): v for k, v in written.items()},
                 _without("state.0.exp_avg", "state.0.exp_avg_sq", "state.0.step")(written)):
        write_state(d, st["step"], st["model"], {OPTIMIZER_FILE: optimizer_bytes_of(edit)})
        assert read_state(d).step == K - 1
    assert adapter_bytes(tensorfile.load(d / ADAPTER_WEIGHTS)) == (d / ADAPTER_WEIGHTS).read_bytes()


def test_a_start_state_pinned_with_learning_rates_of_several_param_groups_is_refused(
        step_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the built-in trainer's AdamW has one param group: a second learning rate (even an equal one) was admitted
    run, pin = _resealed(step_run, tmp_path, manifest=lambda d: d["state"].update(lr=d["state"]["lr"] * 2))
    for out in _explain_and_replay(run, pin, capsys):
        assert out.startswith("2|") and "state.lr" in out and "Traceback" not in out, out


def _initial_adapter(workspace: Path, capture_dir: Path, tmp_path: Path,
                     edit: Callable[[Tensors], Tensors]) -> tuple[Path, str, str]:
    """A copy of the workspace whose initialisation adapter is ``edit``-ed and re-pinned in trainer_state.json and
    in the capture manifest (its initial_adapter digest and size); returns the replay config and both pins."""
    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws, ignore=shutil.ignore_patterns("source"))
    shutil.copytree(capture_dir, ws / "source")
    sd = ws / "init_resume"
    data = adapter_bytes(edit(tensorfile.load(sd / ADAPTER_WEIGHTS)))
    (sd / ADAPTER_WEIGHTS).write_bytes(data)
    st = json.loads((sd / STATE_FILE).read_text())
    write_state(sd, st["step"], st["model"], {})
    (path,) = (ws / "source").glob("*.manifest.json")
    doc = json.loads(path.read_text())
    doc["initial_adapter"].update(sha256=sha256_bytes(data), size=len(data))
    manifest = canonical_bytes(doc) + b"\n"
    path.write_bytes(manifest)
    return ws / "replay.toml", doc["logical_batch_sha256"], sha256_bytes(manifest)


@pytest.mark.parametrize(("edit", "named"), [
    (lambda t: {k: v.double() for k, v in t.items()}, "is torch.float64, the model's dtype is torch.float32"),
    (lambda t: {**t, next(iter(t)): torch.zeros(3, 3)}, "has shape [3, 3]; lora_A has lora.r = 8 rows"),
    (lambda t: {k: v for i, (k, v) in enumerate(t.items()) if i}, "k_proj has lora_B without lora_A"),
    (lambda t: {**t, "extra": torch.zeros(2)}, "tensor 'extra' is not a LoRA weight"),
    (lambda t: {k.replace("k_proj", "gate_proj"): v for k, v in t.items()},
     "gate_proj.lora_A.weight adapts a module lora.target_modules does not name"),
])
def test_an_initial_adapter_the_config_cannot_attach_is_refused_before_any_model_is_built(
        edit: Callable[[Tensors], Tensors], named: str, workspace: Path, capture_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # explain admitted each (it never builds the model); replay then refused it once the model was built
    cfg, logical, pin = _initial_adapter(workspace, capture_dir, tmp_path, edit)
    capsys.readouterr()
    assert main(["explain", str(cfg), "--set", f'optimizer_batch.expected_logical_sha256="{logical}"',
                 "--set", f'optimizer_batch.expected_manifest_sha256="{pin}"']) == 2
    out = capsys.readouterr().out
    assert "the adapter cannot load into the model this config builds" in out and named in out, out


def _resealed_rows(workspace: Path, capture_dir: Path, tmp_path: Path, field: str,
                   edit: Callable[[torch.Tensor], None]) -> tuple[Path, str, str]:
    """A copy of the step-zero capture whose payload's ``field`` is ``edit``-ed, re-encoded and re-pinned (payload
    size and span digest, row summary, logical and effective digests, the manifest); its replay config and pins."""
    import dataclasses

    from replayjob.artifacts import capture_payload as cp
    ws = tmp_path / "ws"
    shutil.copytree(workspace, ws, ignore=shutil.ignore_patterns("source"))
    shutil.copytree(capture_dir, ws / "source")
    (path,) = (ws / "source").glob("*.manifest.json")
    doc = json.loads(path.read_text())
    pay = ws / "source" / doc["payload"]["file"]
    batch, rng = cp.decode(pay.read_bytes())
    values = getattr(batch, field).clone()
    edit(values)
    batch = dataclasses.replace(batch, **{field: values})
    data = cp.encode(batch, rng)
    pay.write_bytes(data)
    logical, effective = batch.digests()
    doc["payload"].update(size=len(data), spans_sha256=cp.digest_bytes(data))
    doc.update(rows=cp.summary(batch), logical_batch_sha256=logical, local_effective_rows_sha256=effective)
    raw = canonical_bytes(doc) + b"\n"
    path.write_bytes(raw)
    return ws / "replay.toml", logical, sha256_bytes(raw)


def test_a_replay_whose_gradient_norm_is_not_finite_records_it_as_null(
        workspace: Path, capture_dir: Path, tmp_path: Path) -> None:
    # advantages of 1e300 (beyond the model's float32): the gradient norm is NaN, which the record declares null
    # (as a source's step record has it); the replay failed to write its record ("cannot write JSON", exit 2) and
    # left final_adapter/ behind without it
    cfg, logical, pin = _resealed_rows(workspace, capture_dir, tmp_path, "advantages",
                                       lambda t: t.__setitem__(0, 1e300))
    out = tmp_path / "r"
    assert main(["replay", str(cfg), "--out", str(out), "--set", f'optimizer_batch.expected_logical_sha256="{logical}"',
                 "--set", f'optimizer_batch.expected_manifest_sha256="{pin}"']) == 0
    doc = json.loads((out / "replay_metrics.json").read_text())
    assert doc["grad_norm"] is None and isinstance(doc["loss"], float) and doc["nonfinite_outcome"] == ["grad_norm"]


def test_a_captured_token_id_beyond_the_models_vocabulary_is_refused_by_explain(
        workspace: Path, capture_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # re-sealed rows holding token id 10**6: explain admitted them (it builds no model); replay then refused them
    cfg, logical, pin = _resealed_rows(workspace, capture_dir, tmp_path, "tokens", lambda t: t.__setitem__(5, 10**6))
    capsys.readouterr()
    assert main(["explain", str(cfg), "--set", f'optimizer_batch.expected_logical_sha256="{logical}"',
                 "--set", f'optimizer_batch.expected_manifest_sha256="{pin}"']) == 2
    out = capsys.readouterr().out
    assert "captured token id 1000000 is outside this model's vocabulary (260)" in out, out


@pytest.mark.parametrize(("rng", "named"), [
    (lambda cpu: {"foo": cpu}, "rng.safetensors holds no cpu state (it holds ['foo'])"),
    (lambda cpu: {"cpu": cpu, "foo": cpu}, "rng.foo is not a Torch RNG state (expected cpu or cuda.N)"),
    (lambda cpu: {"cpu": cpu, "cuda.0": torch.zeros(16, dtype=torch.uint8).index_fill_(0, torch.tensor([8]), 2)},
     "rng.cuda.0 holds Philox offset 2"),
])
def test_a_resume_states_rng_file_the_generators_would_not_take_is_refused_when_read(
        rng: Callable[[torch.Tensor], Tensors], named: str, workspace: Path, tmp_path: Path) -> None:
    # a checkpoint's RNG states were read only when a resumed run restored them: one without the CPU state failed
    # there with exit 3 (KeyError), a key that is no generator's was ignored
    from replayjob.rl.state import RNG_FILE, rng_tensors, safetensors_bytes
    d = tmp_path / "state"
    shutil.copytree(workspace / "init_resume", d)
    st = json.loads((d / STATE_FILE).read_text())
    write_state(d, 0, st["model"], {RNG_FILE: safetensors_bytes(rng(rng_tensors()["cpu"]), "replayjob-rng")})
    with pytest.raises(IntegrityError) as exc:
        read_state(d)
    assert named in exc.value.message and str(d / RNG_FILE) in str(exc.value.where), exc.value.diagnostics()


def test_a_world_size_above_the_captured_rows_is_refused_by_explain(
        workspace: Path, capture_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 32 ranks for 16 rows: explain admitted it; the replay's ranks then refused it once launched
    from tests.conftest import replay_pins
    capsys.readouterr()
    assert main(["explain", str(workspace / "replay.toml"), "--nproc", "32", *replay_pins(capture_dir),
                 "--set", "distributed.world_size=32",
                 "--set", 'optimizer_batch.allow_config_differences=["distributed.world_size"]']) == 2
    out = capsys.readouterr().out
    assert "16 logical rows cannot be split over 32 ranks" in out, out


@pytest.mark.parametrize("setting", ["capture_steps=[0]", "ring_size=3", "ring_grad_norm_above=3.0",
                                     "ring_loss_spike_multiple=2.0", "capture=true"])
def test_a_source_run_setting_in_a_replay_config_is_refused_for_every_producer(
        setting: str, workspace: Path, capture_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the capture API refused capture, capture_steps and ring_size; the built-in trainer's admission refused
    # capture only, and a ring trigger passed both (read by nothing in a replay)
    from tests.conftest import replay_pins
    capsys.readouterr()
    assert main(["explain", str(workspace / "replay.toml"), *replay_pins(capture_dir),
                 "--set", f"optimizer_batch.{setting}"]) == 2
    out = capsys.readouterr().out
    key, value = setting.split("=")
    assert f"optimizer_batch.{key} = {value}: source-run settings" in out, out
