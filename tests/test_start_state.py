"""The state an update starts from holds what training could have produced, checked when the state is read
(:func:`replayjob.rl.state.read_state`, used by capture, training and admission alike): an initialisation state
(step -1) carries no optimizer or RNG state; the adapter and the optimizer state are finite, the second moments
non-negative, and every per-parameter step count is the number of optimizer steps the state's step implies.
Each is refused (exit 2) naming the file and the tensor, before any model is built."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from replayjob import tensorfile
from replayjob.cli import main
from replayjob.errors import IntegrityError
from replayjob.rl.state import (
    ADAPTER_WEIGHTS,
    EMPTY_STATE,
    OPTIMIZER_FILE,
    RNG_FILE,
    STATE_FILE,
    adapter_bytes,
    optimizer_bytes_of,
    read_state,
    rng_bytes,
    write_state,
)
from tests.conftest import replay_pins

Tensors = dict[str, torch.Tensor]


def _adam(steps: float, **edit: Callable[[torch.Tensor], torch.Tensor]) -> Tensors:
    """An AdamW state of two parameters of the workspace adapter's shape [8, 64] after ``steps`` steps (``edit``:
    per key, a change to each tensor)."""
    out = {}
    for i in range(2):
        t = {"exp_avg": torch.full((8, 64), 0.1), "exp_avg_sq": torch.full((8, 64), 0.01),
             "step": torch.tensor(steps)}
        for key, value in t.items():
            out[f"state.{i}.{key}"] = edit[key](value.clone()) if key in edit else value
    return out


def _state(workspace: Path, tmp_path: Path, step: int, optimizer: Tensors | None = None, *, rng: bool = False,
           adapter: Callable[[Tensors], None] | None = None) -> Path:
    """A copy of the workspace's initialisation state as a state of ``step``, re-pinned (trainer_state.json
    rewritten by the writer), with ``optimizer`` as its optimizer file and ``adapter`` applied to its adapter."""
    d = tmp_path / f"state{step}"
    shutil.copytree(workspace / "init_resume", d)
    if adapter is not None:
        tensors = tensorfile.load(d / ADAPTER_WEIGHTS)
        adapter(tensors)
        (d / ADAPTER_WEIGHTS).write_bytes(adapter_bytes(tensors))
    extra = {} if optimizer is None else {OPTIMIZER_FILE: optimizer_bytes_of(optimizer)}
    if rng:
        extra[RNG_FILE] = rng_bytes()
    model = json.loads((d / STATE_FILE).read_text())["model"]
    write_state(d, step, model, extra)
    return d


def _nan_first(tensors: Tensors) -> None:
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")


def test_states_training_writes_are_read(workspace: Path, tmp_path: Path) -> None:
    """A checkpoint of step 1 (two optimizer steps), a chosen step zero's state (step -1, the empty optimizer
    state) and a checkpoint in the names written before the shared ones (``<i>.<key>``) are admitted."""
    assert read_state(_state(workspace, tmp_path, 1, _adam(2.0), rng=True)).step == 1
    # a parameter that got no gradient in a step (an expert's adapter no token reached) was not stepped then
    assert read_state(_state(workspace, tmp_path / "lag", 1, _adam(1.0), rng=True)).step == 1
    assert read_state(_state(workspace, tmp_path, -1, {})).has_optimizer
    legacy = {k.removeprefix("state."): v for k, v in _adam(3.0).items()}
    assert read_state(_state(workspace, tmp_path, 2, legacy)).step == 2


@pytest.mark.parametrize(("step", "optimizer", "rng", "named"), [
    (-1, _adam(1.0), False, "an initialisation state (step -1) starts a fresh optimizer"),
    (-1, None, True, "an initialisation state (step -1) holds no RNG state"),
    (1, _adam(100.0), False, "tensor state.0.step counts 100.0 optimizer step(s), but it is a state of step 1 "
                             "(after 2 optimizer step(s))"),
    (1, _adam(2.5), False, "tensor state.1.step counts 2.5 optimizer step(s)"),
    (1, _adam(-1.0), False, "tensor state.1.step counts -1.0 optimizer step(s)"),
    (2, {k.removeprefix("state."): v for k, v in _adam(7.0).items()}, False, "tensor 0.step counts 7.0"),
    (1, _adam(2.0, exp_avg=lambda t: t.index_fill_(0, torch.tensor([1]), float("nan"))), False,
     "tensor state.0.exp_avg holds 64 NaN or infinite value(s)"),
    (1, _adam(2.0, exp_avg_sq=lambda t: -t), False, "tensor state.1.exp_avg_sq holds 512 negative value(s)"),
    (1, _adam(2.0, exp_avg_sq=lambda t: t.fill_(float("inf"))), False, "tensor state.0.exp_avg_sq holds 512 NaN"),
])
def test_a_state_its_step_contradicts_is_refused(step: int, optimizer: Tensors | None, rng: bool, named: str,
                                                 workspace: Path, tmp_path: Path) -> None:
    d = _state(workspace, tmp_path, step, optimizer, rng=rng)
    with pytest.raises(IntegrityError) as exc:
        read_state(d)
    assert named in exc.value.message and str(d) in str(exc.value.where), exc.value.diagnostics()


def test_a_nan_in_the_adapter_is_refused_naming_the_tensor(workspace: Path, tmp_path: Path) -> None:
    d = _state(workspace, tmp_path, -1, adapter=_nan_first)
    with pytest.raises(IntegrityError, match=r"tensor \S+lora_\S+ holds 1 NaN or infinite value\(s\)") as exc:
        read_state(d)
    assert exc.value.where == str(d / ADAPTER_WEIGHTS)


def _explain_and_replay_refuse(capsys: pytest.CaptureFixture[str], workspace: Path, capture_dir: Path, state: Path,
                               out: Path, *needles: str) -> None:
    sets = [*replay_pins(capture_dir), "--set", f'resume.from="{state}"']
    for argv in (["explain", str(workspace / "replay.toml"), *sets],
                 ["replay", str(workspace / "replay.toml"), *sets, "--out", str(out)]):
        assert main(argv) == 2, argv[0]
        err = capsys.readouterr().err
        assert "Traceback" not in err and all(n in err for n in needles), err
    assert not out.exists()


def test_an_initialisation_state_with_an_optimizer_state_is_refused_by_capture_and_admission(
        workspace: Path, capture_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Capture loaded such moments while its manifest recorded a fresh optimizer; both now refuse the state."""
    adapter = tensorfile.load(workspace / "init_resume" / ADAPTER_WEIGHTS)
    moments = {f"state.{i}.{k}": (torch.tensor(3.0) if k == "step" else torch.full_like(adapter[n], 0.1))
               for i, n in enumerate(sorted(adapter)) for k in ("exp_avg", "exp_avg_sq", "step")}
    state = _state(workspace, tmp_path, -1, moments)
    needle = "an initialisation state (step -1) starts a fresh optimizer"
    out = tmp_path / "cap"
    assert main(["capture", str(workspace / "source.toml"), "--out", str(out),
                 "--set", f'resume.from="{state}"']) == 2
    err = capsys.readouterr().err
    assert needle in err and str(state / OPTIMIZER_FILE) in err and "Traceback" not in err, err
    assert not list(out.glob("*.manifest.json"))
    _explain_and_replay_refuse(capsys, workspace, capture_dir, state, tmp_path / "r", needle)


def test_a_nan_in_the_initial_adapter_is_refused_before_any_work(
        workspace: Path, capture_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was admitted, and the replay failed writing its metrics (``cannot write JSON: ... nan``)."""
    state = _state(workspace, tmp_path, -1, adapter=_nan_first)
    _explain_and_replay_refuse(capsys, workspace, capture_dir, state, tmp_path / "r",
                               str(state / ADAPTER_WEIGHTS), "holds 1 NaN or infinite value(s)")


def test_the_empty_optimizer_state_is_the_only_one_an_initialisation_state_holds(workspace: Path,
                                                                                  tmp_path: Path) -> None:
    d = _state(workspace, tmp_path, -1, {})
    assert set(tensorfile.load(d / OPTIMIZER_FILE)) == {EMPTY_STATE}
    assert read_state(d).step == -1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_a_cuda_rng_state_without_its_device_is_refused_naming_it(tmp_path: Path) -> None:
    """A well-formed CUDA RNG state on a host that does not see its device: refused (exit 2) naming the state, its
    file and the fix, before any generator is touched."""
    from replayjob.errors import ContractError
    from replayjob.rl.state import restore_rng

    where = tmp_path / "payload.safetensors"
    state = {"cpu": torch.get_rng_state(), "cuda.0": torch.zeros(16, dtype=torch.uint8)}
    with pytest.raises(ContractError) as exc:
        restore_rng(state, where=where)
    assert exc.value.exit_code == 2 and "rng.cuda.0" in exc.value.message and exc.value.where == str(where) \
        and "CUDA_VISIBLE_DEVICES" in (exc.value.hint or ""), exc.value.diagnostics()
