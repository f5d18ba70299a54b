"""Golden files: a capture manifest, a bundle, exact-input and approximate verdicts, diag-diff JSON.

Each output is built from fixed inputs (no clock, no random draw, no absolute path, values exact in
binary floating point) and compared byte for byte with ``tests/golden/``; a change in a format, a
digest algorithm or a statistic shows up here first.  Regenerate on purpose only, after reviewing
the difference: ``REPLAYJOB_REGEN_GOLDEN=1 pytest tests/test_golden.py`` (conftest.assert_golden).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import GOLDEN, assert_golden
from safetensors.torch import save

from replayjob.artifacts import capture_manifest as mf
from replayjob.artifacts import capture_payload as payload
from replayjob.bundle import load_bundle
from replayjob.bundle.synthetic import write_rollout
from replayjob.cli import main
from replayjob.digest import sha256_bytes, sha256_file
from replayjob.gate import synthetic
from replayjob.jsonio import pretty_bytes
from replayjob.rl.batch import OptimizerBatch
from replayjob.runtime.knobs import GRADIENT_CHECKPOINTING as GC_KEY

ARMS = {"baseline": {}, "gradient_checkpointing=true": {GC_KEY: True}}


def fixed_batch() -> OptimizerBatch:
    """Three ragged rows whose float64 fields are multiples of 1/8 (exact everywhere)."""
    resp = [2, 3, 4]
    seqs = [[5 + i, 6, 9] + [7 + i] * n for i, n in enumerate(resp)]
    mask = torch.zeros((3, 4), dtype=torch.float64)
    for i, n in enumerate(resp):
        mask[i, :n] = 1
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4) / 8
    fields = {"old_logprobs": -base, "ref_logprobs": -base - 0.125, "advantages": base - 0.75,
              "loss_weights": torch.full((3, 4), 1 / 8, dtype=torch.float64)}
    return OptimizerBatch.from_padded(seqs, [3, 3, 3], {k: v * mask for k, v in fields.items()}, mask)


def test_capture_manifest(tmp_path: Path) -> None:
    batch = fixed_batch()
    rng = {"cpu": torch.Generator().manual_seed(123).get_state()}
    data = payload.encode(batch, rng)
    logical, effective = batch.digests()
    adapter = b"initial adapter weights"
    doc = mf.build(step=0, producer={"replayjob_version": "golden", "device": "cpu"},
                   payload_file=mf.payload_name(0), payload_size=len(data),
                   payload_digest=payload.digest_bytes(data), rng_keys=list(rng), rows=payload.summary(batch),
                   logical=logical, effective=effective,
                   resolved_config={"training": {"micro_batch_size": 2, "seed": 123}, "lora": {"dropout": 0.0}},
                   contract={"algorithm": {"loss": "grpo"}, "strict_deterministic": True},
                   adapter_path=Path("init_resume") / "adapter_model.safetensors", adapter_size=len(adapter),
                   adapter_sha256=sha256_bytes(adapter))
    path = tmp_path / mf.manifest_name(0)
    sha = mf.write(path, doc)
    assert_golden(GOLDEN / "capture_manifest.json", path.read_bytes())
    (tmp_path / mf.payload_name(0)).write_bytes(data)
    assert mf.read_verified(path, sha).payload_digest == payload.digest_bytes(data)


def test_bundle(tmp_path: Path) -> None:
    root = write_rollout(tmp_path / "b")
    load_bundle(root)  # valid
    files = {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}
    listing = {"files": files, "manifest": json.loads((root / "manifest.json").read_text())}
    assert_golden(GOLDEN / "bundle_rollout.json", pretty_bytes(listing))


def test_exact_input_verdict(tmp_path: Path) -> None:
    ev = synthetic.build(tmp_path / "ev", ARMS, 3, seed=11)
    out = tmp_path / "out" / "verdict.json"
    assert main(["reduce", str(ev.root / "replays"), "--claim", "exact-input", "--out", str(out),
                 "--source", str(ev.source), "--baseline", "baseline"]) == 0
    assert_golden(GOLDEN / "verdict_exact_input.json", out.read_bytes())


def integer_adapter(offset: int) -> dict[str, torch.Tensor]:
    """Small integer-valued tensors: every dot product and norm of the updates is exact, so the update
    geometry does not depend on the order a BLAS sums in."""
    return {"layer.0.lora_A.weight": (torch.arange(8, dtype=torch.float32).reshape(2, 4) + offset) % 5,
            "layer.0.lora_B.weight": (torch.arange(8, dtype=torch.float32).reshape(4, 2) * (offset + 1)) % 7}


def test_approximate_verdict(tmp_path: Path) -> None:
    tol = b"update_cosine_min = 0.5\nrelative_delta_l2_max = 2.0\n"
    (tmp_path / "tolerances.toml").write_bytes(tol)
    ev = synthetic.build(tmp_path / "ev", ARMS, 3, initial=save(integer_adapter(0)),
                         final=lambda arm, i: save(integer_adapter(1 + i + (arm != "baseline"))),
                         source_final=save(integer_adapter(1)), tolerances_sha256=sha256_bytes(tol), seed=5)
    out = tmp_path / "out" / "verdict.json"
    code = main(["reduce", str(ev.root / "replays"), "--claim", "approximate", "--out", str(out),
                 "--source", str(ev.source), "--tolerances", str(tmp_path / "tolerances.toml")])
    doc = json.loads(out.read_bytes())
    assert code == doc["exit_code"] and doc["updates"] is not None, doc["failed_checks"]
    assert_golden(GOLDEN / "verdict_approximate.json", out.read_bytes())


def test_diag_diff_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> None:
    rows_a = [{"step": 0, "loss": 1.0, "grad": {"norm": 0.5}, "wall_s": 1.0},
              {"step": 1, "loss": 0.75, "grad": {"norm": 0.25}, "tokens": [1, 2, 3]},
              {"step": 2, "loss": 0.5, "grad": {"norm": 0.125}, "mode": "a"}]
    rows_b = [{"step": 0, "loss": 1.0, "grad": {"norm": 0.5}, "wall_s": 9.0},
              {"step": 1, "loss": 0.875, "grad": {"norm": 0.25}, "tokens": [1, 2, 4], "extra": True},
              {"step": 2, "loss": float("nan"), "grad": {}, "mode": 1}]
    for name, rows in (("a.jsonl", rows_a), ("b.jsonl", rows_b)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    assert main(["diag-diff", "a.jsonl", "b.jsonl", "--json"]) == 1
    assert_golden(GOLDEN / "diag_diff.json", capsys.readouterr().out.encode("utf-8"))
