"""Docs generated from code stay current (regenerate with REPLAYJOB_REGEN_GOLDEN=1)."""

from __future__ import annotations

import os

from conftest import REPO

from replayjob.config.reference import reference_markdown


def test_config_reference_is_current() -> None:
    path = REPO / "docs" / "config.md"
    text = reference_markdown()
    if os.environ.get("REPLAYJOB_REGEN_GOLDEN"):
        path.write_text(text)
    assert path.read_text() == text, "docs/config.md is stale: python -m replayjob.config.reference > docs/config.md"
