"""Docs generated from code stay current (regenerate with REPLAYJOB_REGEN_GOLDEN=1)."""

from __future__ import annotations

from conftest import REPO, assert_golden

from replayjob.config.reference import reference_markdown


def test_config_reference_is_current() -> None:
    path = REPO / "docs" / "config.md"
    text = reference_markdown()
    assert_golden(path, text.encode("utf-8"))  # or: python -m replayjob.config.reference > docs/config.md
