"""docs/verl.md carries the classification table of every verl config field exactly as verl_fields declares it.

Runs in the main environment (verl_fields imports nothing from verl); the walk over the installed verl's
dataclasses is in tests/test_verl.py, which needs verl.
"""

from __future__ import annotations

from pathlib import Path

from replayjob.producers.verl import fields as verl_fields
from replayjob.producers.verl.fields import DOC_BEGIN, DOC_END, FIELDS, KINDS, KNOB

DOC = Path(__file__).resolve().parents[1] / "docs" / "verl.md"


def test_the_verl_page_carries_the_generated_table() -> None:
    text = DOC.read_text(encoding="utf-8")
    begin, end = text.index(DOC_BEGIN) + len(DOC_BEGIN), text.index(DOC_END)
    assert text[begin:end] == verl_fields.table(), "regenerate: python -m replayjob.producers.verl.fields"


def test_every_class_is_known_and_every_knob_is_registered() -> None:
    from replayjob.runtime import knobs

    registered = knobs.knobs_for("verl")
    for section, fields in FIELDS.items():
        for name, f in fields.items():
            assert f.kind in KINDS, (section, name)
            assert not f.keys or f.kind == KNOB, (section, name)  # entries of a table-valued knob
            for key in [f"verl.{section}.{name}.{k}" for k in f.keys] or [f"verl.{section}.{name}"]:
                assert f.kind != KNOB or key in registered, f"{key} is not a registered knob"
    # every registered knob is a classified field, but the process count: how the replay is launched (--nproc)
    assert sorted(registered) == sorted([*verl_fields.knob_keys(), knobs.NUM_PROCESSES])
