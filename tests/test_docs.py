"""Docs generated from code stay current (regenerate with REPLAYJOB_REGEN_GOLDEN=1)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import REPO, assert_golden

from replayjob.artifacts.spec import AblationSpec, CaptureRef
from replayjob.config.reference import reference_markdown
from replayjob.gate.budgets import KIND_DOCS, KINDS, MEMORY_METRIC, METRIC_DOCS, TIME_METRICS, read_budgets
from replayjob.launch.reference import budgets_markdown, spec_markdown
from replayjob.launch.reference import main as reference_main


def test_config_reference_is_current() -> None:
    path = REPO / "docs" / "config.md"
    text = reference_markdown()
    assert_golden(path, text.encode("utf-8"))  # or: python -m replayjob.config.reference > docs/config.md


def test_spec_reference_is_current() -> None:
    path = REPO / "docs" / "spec.md"
    assert_golden(path, spec_markdown().encode("utf-8"))  # or: python -m replayjob.launch.reference spec > docs/spec.md


def test_budgets_reference_is_current() -> None:
    path = REPO / "docs" / "budgets.md"
    assert_golden(path, budgets_markdown().encode("utf-8"))  # or: ... reference budgets > docs/budgets.md


def test_every_budget_metric_and_kind_has_a_doc() -> None:
    assert set(METRIC_DOCS) == {*TIME_METRICS, MEMORY_METRIC}
    assert set(KIND_DOCS) == set(KINDS)
    assert all(METRIC_DOCS.values()) and all(KIND_DOCS.values())


def test_every_spec_field_has_a_doc() -> None:
    for cls in (AblationSpec, CaptureRef):
        assert all(f.metadata.get("doc") for f in dataclasses.fields(cls)), cls.__name__


def test_budgets_example_reads(tmp_path: Path) -> None:
    text = budgets_markdown().split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "budgets.toml").write_text(text)
    budgets = read_budgets(tmp_path / "budgets.toml")
    assert budgets.baseline == "ckpt-off" and len(budgets.bounds) == 3


def test_reference_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert reference_main(["budgets"]) == 0
    assert capsys.readouterr().out == budgets_markdown()
    for argv in ([], ["config"], ["spec", "budgets"]):
        assert reference_main(argv) == 2
        assert capsys.readouterr().err.startswith("usage:")
