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


def test_the_readme_file_tree_lists_every_module() -> None:
    """The README's tree of replayjob/ names every module where it lies (a folder listed without its files, the
    deprecated import paths, stands for all of them) and names no module that is gone."""
    import re

    repo = Path(__file__).resolve().parents[1]
    lines = (repo / "README.md").read_text(encoding="utf-8").split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("replayjob/ "))
    stack: list[str] = []
    files: set[str] = set()
    folders: dict[str, int] = {}
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        m = re.match(r"^( +)(\S+)", line)
        if m is None or m.group(2).startswith("#"):
            continue
        depth, name = len(m.group(1)) // 2, m.group(2)
        stack = stack[:depth - 1]
        path = "/".join(["replayjob", *stack, name.rstrip("/")])
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
            folders[path] = 0
        else:
            files.add(path)
            for k in range(1, len(stack) + 1):
                folders["/".join(["replayjob", *stack[:k]])] = folders.get("/".join(["replayjob", *stack[:k]]), 0) + 1
    whole = {f for f, n in folders.items() if n == 0}  # a folder listed without its files stands for all of them
    modules = {p.relative_to(repo).as_posix() for p in (repo / "replayjob").rglob("*.py") if p.name != "__init__.py"}
    missing = sorted(m for m in modules - files if not any(m.startswith(f + "/") for f in whole))
    gone = sorted(f for f in files if f.endswith(".py") and not (repo / f).is_file())
    assert (missing, gone) == ([], []), "README 'File tree': add the missing modules, remove the gone ones"


def test_every_docstring_example_holds() -> None:
    """The examples in the package's docstrings are run (doctest) and hold, so a docstring never shows output the
    code no longer gives.  The plugins verl imports, and the deprecated paths that forward to them, are left out:
    importing them is their work."""
    import doctest
    import importlib

    repo = Path(__file__).resolve().parents[1]
    failed: list[str] = []
    for p in sorted((repo / "replayjob").rglob("*.py")):
        parts = p.relative_to(repo).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        skip = name in ("replayjob.__main__", "replayjob.producers.verl.plugin")
        if skip or name.startswith("replayjob.integrations"):
            continue
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False,
                                 report=False)
        if result.failed:
            failed.append(f"{name}: {result.failed} of {result.attempted}")
    assert failed == []
