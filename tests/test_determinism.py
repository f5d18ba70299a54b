"""Determinism controls: what strict mode sets, what it refuses, what provenance records."""

from __future__ import annotations

import pytest
import torch

from replayjob.errors import DeterminismError
from replayjob.runtime import determinism


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(determinism, "_process_mode", None)
    monkeypatch.delenv("REPLAYJOB_MATH_MODE", raising=False)


def test_strict_sets_every_control_and_records_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    prov = determinism.establish(strict=True, seed=3)
    assert torch.are_deterministic_algorithms_enabled()
    assert prov["strict_deterministic"] is True and prov["math_mode"] == "pedantic"
    assert prov["cublas_workspace_config"] == ":4096:8"
    assert prov["cudnn_deterministic"] and not prov["cudnn_benchmark"]
    assert not prov["cuda_matmul_allow_tf32"] and not prov["cudnn_allow_tf32"]
    assert prov["float32_matmul_precision"] == "highest"


def test_every_test_starts_from_the_session_baseline() -> None:
    """Runs after the strict test above: conftest's autouse fixture put torch's controls back."""
    from conftest import BASELINE, determinism_state

    assert determinism_state() == BASELINE
    assert not torch.are_deterministic_algorithms_enabled()


def test_restore_puts_back_every_control() -> None:
    from conftest import BASELINE, determinism_state, restore_determinism

    determinism.establish(strict=True, seed=1)
    determinism.mark_model_built(True)
    changed = determinism_state()
    assert changed != BASELINE and changed["deterministic_algorithms"] and changed["process_mode"] == "strict"
    restore_determinism(BASELINE)
    assert determinism_state() == BASELINE


@pytest.mark.parametrize("value", [":16:8", ":4096:8"])
def test_existing_deterministic_cublas_setting_is_kept(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", value)
    assert determinism.establish(strict=True, seed=0)["cublas_workspace_config"] == value


def test_nondeterministic_cublas_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(DeterminismError, match="not deterministic"):
        determinism.establish(strict=True, seed=0)


def test_strict_needs_a_seed() -> None:
    with pytest.raises(DeterminismError, match="seed"):
        determinism.establish(strict=True, seed=None)


def test_prod_math_mode_contradicts_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REPLAYJOB_MATH_MODE", "prod")
    with pytest.raises(DeterminismError, match="TF32"):
        determinism.establish(strict=True, seed=0)


def test_unknown_math_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REPLAYJOB_MATH_MODE", "fast")
    with pytest.raises(DeterminismError, match="not a math mode"):
        determinism.establish(strict=False, seed=0)


def test_strict_refused_after_relaxed_model_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    determinism.establish(strict=False, seed=0)
    determinism.mark_model_built(False)
    with pytest.raises(DeterminismError, match="without strict determinism"):
        determinism.establish(strict=True, seed=0)
