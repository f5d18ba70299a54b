"""docs/verl.md carries the classification table of every verl config field exactly as verl_fields declares it.

Runs in the main environment (verl_fields imports nothing from verl); the walk over the installed verl's
dataclasses is in tests/test_verl.py, which needs verl.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from replayjob.producers.verl import fields as verl_fields
from replayjob.producers.verl.fields import (
    CONTRACT,
    DOC_BEGIN,
    DOC_END,
    FIELDS,
    KINDS,
    KNOB,
    value_reason,
    value_reasons,
)

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


def test_every_contract_field_declares_its_type_and_range() -> None:
    for section, fields in FIELDS.items():
        for name, f in fields.items():
            assert (f.spec is not None) == (f.kind == CONTRACT), (section, name)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e39, "0.2", True, None, [0.2]])
def test_a_number_is_finite_within_float32_and_of_its_json_type(value: object) -> None:
    """JSON has no NaN (the reader refuses it), but a live config may hold one: the capture refuses it by the same
    rule admission reads the recorded value back by."""
    assert value_reasons("actor", "clip_ratio", value) == [
        f"verl.actor.clip_ratio is {value!r}; it takes a number in [0, 1] (finite, within float32's range)"]
    assert value_reasons("actor", "clip_ratio", 0.2) == []


def test_a_table_of_a_verl_dataclass_lists_every_wrong_entry() -> None:
    bad = {"enabled": "no", "zzz": 1}
    assert value_reasons("model", "tiled_mlp", bad) == [
        "verl.model.tiled_mlp.zzz is no entry of verl's tiled MLP table (enabled, num_shards)",
        "verl.model.tiled_mlp.enabled is 'no'; it takes true or false",
        "verl.model.tiled_mlp.num_shards is missing: a capture records every entry of verl's tiled MLP table "
        "(enabled, num_shards)"]
    assert value_reason("model", "tiled_mlp", bad) == "; ".join(value_reasons("model", "tiled_mlp", bad))
    assert value_reasons("model", "tiled_mlp", {"enabled": False, "num_shards": 4}) == []
    assert value_reasons("optim", "min_lr_ratio", None) == []  # declared "or null"
    assert value_reasons("actor", "clip_ratio_c", 1) == ["verl.actor.clip_ratio_c is 1; it takes a number > 1 "
                                                         "(finite, within float32's range)"]
