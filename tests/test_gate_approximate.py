"""The approximate claim over real safetensors adapters: pinned tolerances, update geometry, refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save

from replayjob.cli import main
from replayjob.digest import sha256_bytes
from replayjob.errors import IntegrityError
from replayjob.gate import synthetic, updates
from replayjob.runtime.knobs import GRADIENT_CHECKPOINTING as GC_KEY

OFF, ON = "baseline", "gradient_checkpointing=true"
ARMS: dict[str, dict[str, Any]] = {OFF: {}, ON: {GC_KEY: True}}
TOL = b"update_cosine_min = 0.99\nrelative_delta_l2_max = 0.05\n"


def tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.0.lora_A.weight": torch.randn(4, 16, generator=g) * scale,
            "layer.0.lora_B.weight": torch.randn(16, 4, generator=g) * scale,
            "layer.1.lora_A.weight": torch.randn(4, 16, generator=g, dtype=torch.float64) * scale}


INITIAL = tensors(0)
UPDATE = tensors(1, 1e-2)


def final_bytes(noise: float) -> synthetic.AdapterBytes:
    def make(arm: str, i: int) -> bytes:
        n = tensors(100 + 7 * i + (0 if arm == OFF else 50), noise)
        return save({k: INITIAL[k] + UPDATE[k] + n[k] for k in INITIAL})
    return make


def build(tmp_path: Path, *, tol: bytes = TOL, pinned: bytes | None = None, noise: float = 1e-5
          ) -> tuple[synthetic.Evidence, Path]:
    tol_file = tmp_path / "tolerances.toml"
    tol_file.write_bytes(tol)
    ev = synthetic.build(tmp_path / "ev", ARMS, 3, initial=save(INITIAL), final=final_bytes(noise),
                         source_final=final_bytes(noise)(OFF, 9),
                         tolerances_sha256=sha256_bytes(pinned if pinned is not None else tol))
    return ev, tol_file


def reduce(ev: synthetic.Evidence, tol: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = ev.root.parent / "verdict.json"
    code = main(["reduce", str(ev.root / "replays"), "--claim", "approximate", "--out", str(out),
                 "--source", str(ev.source), "--tolerances", str(tol), *extra])
    return code, json.loads(out.read_text())


def by_name(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in doc["checks"] if c["name"] == name)


def test_approximate_pass_reports_geometry(tmp_path: Path) -> None:
    ev, tol = build(tmp_path)
    code, doc = reduce(ev, tol)
    assert code == 0, doc["failed_checks"]
    up = doc["updates"]
    assert up["all"]["ordered_pairs"] == 7 * 6
    assert set(up["groups"]) == {f"{OFF} ~ {OFF}", f"{OFF} ~ {ON}", f"{ON} ~ {ON}", f"{OFF} ~ source",
                                 f"{ON} ~ source"}
    cos = up["all"]["cosine"]
    assert 0.99 < cos["min"] <= cos["median"] <= cos["max"] < 1.0
    assert doc["inputs"]["initial_adapter"]["path"] == "ev/init_resume/adapter_model.safetensors"
    assert doc["parameters"]["tolerances"] == {"update_cosine_min": 0.99, "relative_delta_l2_max": 0.05}


def test_tolerance_breach_fails_naming_the_check(tmp_path: Path) -> None:
    tight = b"update_cosine_min = 0.999999999\nrelative_delta_l2_max = 1e-9\n"
    ev, tol = build(tmp_path, tol=tight)
    code, doc = reduce(ev, tol)
    assert code == 1
    assert doc["failed_checks"] == ["approximate.update_cosine", "approximate.relative_delta_l2"]
    assert len(by_name(doc, "approximate.update_cosine")["offenders"]) == 42


def test_unpinned_tolerance_file_is_refused(tmp_path: Path) -> None:
    ev, tol = build(tmp_path, pinned=b"update_cosine_min = 0.5\nrelative_delta_l2_max = 0.5\n")
    code, doc = reduce(ev, tol)
    assert code == 2 and by_name(doc, "inputs.tolerances_pinned")["status"] == "refused"
    assert doc["updates"] is None


@pytest.mark.parametrize(("text", "rule"), [
    (b"update_cosine_min = 0.9\nrelative_delta_l2_max = 0.1\nslack = 1\n", "unknown field `slack`"),
    (b"update_cosine_min = 0.9\n", "missing required field `relative_delta_l2_max`"),
    (b"update_cosine_min = 1.5\nrelative_delta_l2_max = 0.1\n", "field `update_cosine_min`: expected `float` <= 1.0"),
    (b"update_cosine_min = 0.9\nrelative_delta_l2_max = nan\n", "field `relative_delta_l2_max`"),
    (b"update_cosine_min = 0.9\nrelative_delta_l2_max = inf\n", "field `relative_delta_l2_max`"),
    (b"update_cosine_min = true\nrelative_delta_l2_max = 0.1\n", "expected `float`, got `bool`"),
    (b"update_cosine_min = 0.9\nrelative_delta_l2_max = 99999999999999999999\n", "outside the signed 64-bit range"),
])
def test_bad_tolerance_file_is_refused(text: bytes, rule: str, tmp_path: Path) -> None:
    ev, tol = build(tmp_path, tol=text)
    code, doc = reduce(ev, tol)
    assert code == 2 and rule in doc["refusal"]["message"], doc["refusal"]["message"]


def test_unreachable_initial_adapter_is_refused(tmp_path: Path) -> None:
    ev, tol = build(tmp_path)
    ev.initial_adapter.write_bytes(save(tensors(5)))
    code, doc = reduce(ev, tol)
    assert code == 2 and "initial adapter" in doc["refusal"]["message"]


def test_altered_adapter_is_refused_before_geometry(tmp_path: Path) -> None:
    ev, tol = build(tmp_path)
    f = ev.replay_files[2].parent / synthetic.ADAPTER
    f.write_bytes(save(tensors(9)))  # a valid adapter, but not the file the replay recorded
    code, doc = reduce(ev, tol)
    assert code == 2 and by_name(doc, "inputs.final_adapter_on_disk")["offenders"] == [f"{OFF}#2"]
    assert doc["updates"] is None and by_name(doc, "approximate.update_cosine")["detail"].startswith("not evaluated")


def test_pairwise_matches_a_direct_computation(tmp_path: Path) -> None:
    ev, _ = build(tmp_path, noise=1e-3)
    files = [ev.replay_files[0].parent / synthetic.ADAPTER, ev.replay_files[4].parent / synthetic.ADAPTER]
    members = [updates.Member("a", OFF, files[0]), updates.Member("b", ON, files[1])]
    pairs = updates.pairwise(ev.initial_adapter, members)
    init = load_file(str(ev.initial_adapter))
    u = [torch.cat([(load_file(str(f))[k].double() - init[k].double()).flatten() for k in sorted(init)])
         for f in files]
    cos = float(u[0] @ u[1] / (u[0].norm() * u[1].norm()))
    rel = float((u[0] - u[1]).norm() / u[0].norm())
    assert [p.a.label for p in pairs] == ["a", "b"]
    assert math.isclose(pairs[0].cosine or 0, cos, rel_tol=1e-12)
    assert math.isclose(pairs[0].relative_delta_l2 or 0, rel, rel_tol=1e-9)
    assert math.isclose(pairs[1].relative_delta_l2 or 0, float((u[1] - u[0]).norm() / u[1].norm()), rel_tol=1e-9)


def test_mismatched_tensor_names_are_refused(tmp_path: Path) -> None:
    ev, _ = build(tmp_path)
    other = tmp_path / "other.safetensors"
    other.write_bytes(save({"something.else": torch.zeros(2)}))
    with pytest.raises(IntegrityError, match="tensor names differ"):
        updates.pairwise(ev.initial_adapter, [updates.Member("x", OFF, other)])
