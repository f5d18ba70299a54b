"""TRL's default precision (``bf16=True``: bf16 autocast, on CPU too) recorded as a first-class fact of every
capture, and what reads it: same-condition replays stay bitwise, a systems change is judged against the tolerance
the recorded precision suggests (an fp32-derived tolerance would call bf16 rounding a difference), ``explain``
reports both, and ``mismatch`` recomputes the trainer's logprobs in the recorded precision.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the TRL tests need the 'trl' extra: pip install -e '.[trl]'")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch
from trl_scenario import MICRO, capture

from replayjob.cli import main
from replayjob.digest import sha256_file
from replayjob.producers.api import precision

pytestmark = pytest.mark.usefixtures("fresh_determinism_mode")

@pytest.fixture(scope="module")
def bf16(trl_base: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A capture at GRPOConfig's default precision (bf16=True: bf16 autocast on CPU)."""
    return capture(trl_base, tmp_path_factory.mktemp("trl_bf16"))


def _doc(p: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(p.read_text())
    return out


def _update(d: Path, initial: dict[str, torch.Tensor]) -> torch.Tensor:
    from safetensors.torch import load_file
    final = load_file(str(d / "final_adapter" / "adapter_model.safetensors"))
    return torch.cat([(final[n].double() - initial[n].double()).reshape(-1) for n in sorted(initial)])


def test_the_capture_records_the_precision_its_update_computed_in(bf16: Any, trl_capture_nodrop: dict[str, Any],
                                                                  tmp_path: Path) -> None:
    """bf16=True: autocast observed on in bfloat16 on the loss's forward (parameters float32); bf16=False (the
    shared fp32 capture): no autocast, float32.  Same-condition replays of the bf16 capture are bitwise."""
    p = _doc(bf16.manifest)["framework_state"]["precision"]
    assert p["autocast"] == {"enabled": True, "dtype": "bfloat16", "device_type": "cpu"}
    assert (p["mixed_precision"], p["param_dtype"], p["compute_dtype"]) == ("bf16", "float32", "bfloat16")
    assert p["unit_roundoff"] == 2 ** -8 and p["tf32_matmul"] is False
    f = _doc(trl_capture_nodrop["result"].manifest)["framework_state"]["precision"]
    assert f["autocast"]["enabled"] is False and (f["mixed_precision"], f["compute_dtype"]) == ("no", "float32")
    s = _doc(bf16.out_dir / "metrics.json")
    for i in range(2):
        assert main(["replay", str(bf16.replay_toml), "--out", str(tmp_path / f"r{i}")]) == 0
        r = _doc(tmp_path / f"r{i}" / "replay_metrics.json")
        assert r["optimizer_batch/final_adapter_sha256"] == s["optimizer_batch/final_adapter_sha256"]
        assert (r["loss"], r["grad_norm"]) == (s["loss"], s["grad_norm"])


@pytest.mark.slow
def test_a_systems_change_is_judged_against_the_recorded_precision(bf16: Any, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The micro-batch arm of the bf16 capture differs from its baseline by bf16 rounding: beyond the tolerance
    float32 would suggest, within the one the recorded bf16 suggests; explain reports that tolerance."""
    from safetensors.torch import load_file

    initial = load_file(str(bf16.manifest.with_name(bf16.manifest.name.replace(".manifest.json",
                                                                               ".adapter.safetensors"))))
    assert main(["replay", str(bf16.replay_toml), "--out", str(tmp_path / "base")]) == 0
    assert main(["replay", str(bf16.replay_toml), "--out", str(tmp_path / "micro"), *MICRO]) == 0
    a, b = _update(tmp_path / "micro", initial), _update(tmp_path / "base", initial)
    rel = float((a - b).norm() / b.norm())
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    recorded = _doc(bf16.manifest)["framework_state"]["precision"]
    ok = precision.suggested_tolerances(recorded)
    fp32 = precision.suggested_tolerances({**recorded, "autocast": {"enabled": False}})
    assert rel > fp32["relative_delta_l2_max"], rel  # bf16 rounding is a difference at fp32's tolerance
    assert rel <= ok["relative_delta_l2_max"] and cos >= ok["update_cosine_min"], (rel, cos, ok)
    capsys.readouterr()
    assert main(["explain", str(bf16.replay_toml), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["precision"] == recorded and report["suggested_tolerances"] == ok
    # the approximate claim with the suggested tolerance file, pinned before the runs: the arm passes against the
    # baseline and the source; held to float32's, it fails
    for name, tol in (("bf16", ok), ("fp32", fp32)):
        (f := tmp_path / f"{name}.toml").write_text("".join(f"{k} = {v!r}\n" for k, v in tol.items()))
        pin = ["--set", f'optimizer_batch.tolerances_sha256="{sha256_file(f)}"']
        reps = tmp_path / f"claim-{name}"
        assert main(["replay", str(bf16.replay_toml), "--out", str(reps / "baseline"), "--repeat", "1", *pin]) == 0
        assert main(["replay", str(bf16.replay_toml), "--out", str(reps / "micro"), "--repeat", "1", *pin,
                     *MICRO]) == 0
        code = main(["reduce", str(reps), "--claim", "approximate", "--source", str(bf16.out_dir), "--tolerances",
                     str(f), "--baseline", "baseline", "--min-repeats", "1", "--out", str(tmp_path / f"{name}.json")])
        assert code == (0 if name == "bf16" else 1), (name, code)


@pytest.mark.slow
def test_mismatch_recomputes_in_the_recorded_precision(bf16: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """The trainer's side is the recorded autocast dtype (the replay's trainer runs the captured policy: accelerate
    wraps the forward the plain recompute calls too, so it agrees with TRL's own per-token function far below the
    bf16 rounding of a logprob)."""
    capsys.readouterr()
    main(["mismatch", str(bf16.replay_toml), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["trainer"]["dtype"] == "bfloat16", doc["trainer"]
    note = next(n for n in doc["recompute"]["notes"] if n.startswith("TRL's per-token function"))
    agree = float(note.split("agree to ")[1].split(" ")[0])
    assert agree < 1e-3, note


@pytest.mark.slow
def test_trace_diff_bounds_rounding_by_the_recorded_precision(bf16: Any, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The sdpa arm of the bf16 capture, traced: every site is within the envelope of bf16 rounding (the replays
    record compute_dtype); judged by the traced tensors' own dtype (float32 parameters and gradients), it would be
    "beyond"."""
    from replayjob.trace import diff

    toml = str(bf16.replay_toml)
    sdpa = ["--set", 'model.attn_implementation="sdpa"',
            "--set", 'optimizer_batch.allow_config_differences=["model.attn_implementation"]']
    assert main(["replay", toml, "--out", str(tmp_path / "a"), "--trace"]) == 0
    assert main(["replay", toml, "--out", str(tmp_path / "b"), "--trace", *sdpa]) == 0
    assert _doc(tmp_path / "a" / "replay_metrics.json")["provenance"]["compute_dtype"] == "bfloat16"
    capsys.readouterr()
    assert main(["trace-diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["classification"] == "noise"
    monkeypatch.setattr(diff, "COMPUTE_DTYPES", {})  # the tensors' own dtype only
    assert main(["trace-diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["classification"] == "beyond"
