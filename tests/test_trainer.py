"""The source trainer: a real GRPO step, same-seed determinism, and bitwise resume on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from replayjob.cli import main
from replayjob.digest import sha256_file

VARYING = ("timing", "memory")


def rows(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for key in VARYING:
            row.pop(key)
        out.append(row)
    return out


@pytest.fixture(scope="session")
def run_a(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("train") / "a"
    assert main(["train", str(workspace / "train.toml"), "--out", str(out),
                 "--set", "training.max_steps=3", "--set", "training.save_every=1"]) == 0
    return out


def test_train_writes_diag_metrics_and_a_changed_adapter(run_a: Path, workspace: Path) -> None:
    metrics = json.loads((run_a / "metrics.json").read_text())
    init_sha = sha256_file(workspace / "init_resume" / "adapter_model.safetensors")
    assert metrics["initial_adapter_sha256"] == init_sha
    final = run_a / metrics["final_adapter_path"]
    assert sha256_file(final) == metrics["final_adapter_sha256"] != init_sha
    diag = [json.loads(line) for line in (run_a / "diag.jsonl").read_text().splitlines()]
    assert [r["step"] for r in diag] == [0, 1, 2]
    for r in diag:
        assert r["grad_norm"] > 0
        assert set(r["timing"]) >= {"elapsed_s", "forward_wall_s", "backward_wall_s", "optimizer_wall_s"}
        assert r["provenance"] == {"math_mode": "pedantic", "strict_deterministic": True}
    assert metrics["provenance"]["torch_deterministic_algorithms"] is True
    assert metrics["provenance"]["cublas_workspace_config"] in (":4096:8", ":16:8")


@pytest.mark.slow
def test_same_seed_runs_match_apart_from_timing(run_a: Path, workspace: Path, tmp_path: Path) -> None:
    assert main(["train", str(workspace / "train.toml"), "--out", str(tmp_path / "b"),
                 "--set", "training.max_steps=3"]) == 0
    assert rows(tmp_path / "b" / "diag.jsonl") == rows(run_a / "diag.jsonl")
    assert sha256_file(tmp_path / "b/final_adapter/adapter_model.safetensors") == \
        sha256_file(run_a / "final_adapter/adapter_model.safetensors")


@pytest.mark.slow
def test_nondeterministic_observation_makes_runs_differ(run_a: Path, workspace: Path, tmp_path: Path) -> None:
    assert main(["train", str(workspace / "train.toml"), "--out", str(tmp_path / "c"),
                 "--set", "training.max_steps=1", "--set", "environment.nondeterministic_observation=true"]) == 0
    first = rows(tmp_path / "c" / "diag.jsonl")[0]
    assert first["checksums"] != rows(run_a / "diag.jsonl")[0]["checksums"]


@pytest.mark.slow
def test_k_steps_plus_resume_equals_n_steps_bitwise(run_a: Path, workspace: Path, tmp_path: Path) -> None:
    ck = run_a / "checkpoints" / "step_000000"
    assert json.loads((ck / "trainer_state.json").read_text())["step"] == 0
    assert main(["train", str(workspace / "train.toml"), "--out", str(tmp_path / "r"),
                 "--set", "training.max_steps=3", "--set", f"resume.from='{ck}'"]) == 0
    assert rows(tmp_path / "r" / "diag.jsonl") == rows(run_a / "diag.jsonl")[1:]
    assert sha256_file(tmp_path / "r/final_adapter/adapter_model.safetensors") == \
        sha256_file(run_a / "final_adapter/adapter_model.safetensors")


def test_tampered_resume_state_is_refused(run_a: Path, workspace: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(run_a / "checkpoints" / "step_000000", ck)
    with open(ck / "optimizer.safetensors", "r+b") as fh:
        fh.seek(-1, 2)
        last = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([last[0] ^ 1]))
    assert main(["train", str(workspace / "train.toml"), "--out", str(tmp_path / "o"),
                 "--set", "training.max_steps=3", "--set", f"resume.from='{ck}'"]) == 2
    err = capsys.readouterr().err
    assert "optimizer.safetensors has SHA-256" in err and "Traceback" not in err


def test_existing_run_is_not_overwritten(run_a: Path, workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = (run_a / "diag.jsonl").read_bytes()
    assert main(["train", str(workspace / "train.toml"), "--out", str(run_a)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (run_a / "diag.jsonl").read_bytes() == before


def test_init_state_and_reinit_refused(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = json.loads((workspace / "init_resume" / "trainer_state.json").read_text())
    assert state["step"] == -1
    assert state["files"]["adapter_model.safetensors"] == sha256_file(
        workspace / "init_resume" / "adapter_model.safetensors")
    assert main(["init", str(workspace)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_optimizer_and_rng_files_are_loaded_only_under_their_pins(run_a: Path) -> None:
    """The bytes a resume loads are checked against trainer_state.json, not only read_state's earlier read."""
    import torch

    from replayjob.errors import IntegrityError
    from replayjob.rl.state import OPTIMIZER_FILE, RNG_FILE, load_optimizer, load_rng, read_state

    state = read_state(run_a / "checkpoints" / "step_000000")
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(IntegrityError):
        load_optimizer(opt, state.path / OPTIMIZER_FILE, "0" * 64)
    with pytest.raises(IntegrityError):
        load_rng(state.path / RNG_FILE, "0" * 64)
    before = torch.get_rng_state()
    load_rng(state.path / RNG_FILE, state.files[RNG_FILE])  # the right pin loads
    torch.set_rng_state(before)
