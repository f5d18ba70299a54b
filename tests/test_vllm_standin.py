"""The stand-in vLLM sampler (replayjob.producers.trl.vllm_standin) in TRL's place: a vLLM-shaped step captured on a
CPU, replayed bitwise, and its sampler logprobs compared by ``replayjob mismatch``: the gap the stand-in opens by
truncation is attributed to truncation; its precision opens a gap that sampling in the model's dtype does not."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the TRL tests need the 'trl' extra: pip install -e '.[trl]'")
os.environ["HF_HUB_OFFLINE"] = "1"

from conftest import grpo

from replayjob.cli import main
from replayjob.producers.trl.vllm_standin import stand_in

pytestmark = pytest.mark.usefixtures("fresh_determinism_mode")


def _capture(base: Path, out: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, top_k: int) -> tuple[Any, Any]:
    """Step 2 (generated with its own weights: no policy lag) of a use_vllm run sampled by the stand-in."""
    from trl.trainer import grpo_trainer

    cls = stand_in(dtype=dtype, seed=0)
    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", cls)
    _, handle = grpo(base, out, capture_step=2, max_steps=3, use_vllm=True, lora_dropout=0.0, top_k=top_k,
                     temperature=0.9)
    return cls, handle.result


def _sampler(toml: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["mismatch", str(toml), "--json"]) == 2  # no bound declared: the figures decide nothing
    doc = json.loads(capsys.readouterr().out)
    (sampler,) = [s for s in doc["sources"] if s["name"] == "sampler"]
    assert sampler["policy_lag"]["steps"] == 0
    out: dict[str, Any] = sampler
    return out


@pytest.mark.slow
def test_the_stand_in_samples_as_configured_and_its_gap_is_attributed(trl_base: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    cls, res = _capture(trl_base, tmp_path / "trunc", monkeypatch, "bfloat16", 8)
    (kwargs,) = cls.built  # TRL built one generation object with its sampling settings
    assert (kwargs["temperature"], kwargs["top_k"], kwargs["logprobs"]) == (0.9, 8, 0)
    m = json.loads(res.manifest.read_text())
    assert "sampling_per_token_logps" in m["micro_batches"][0]["inputs"]["tensors"]
    assert main(["replay", str(res.replay_toml), "--out", str(tmp_path / "r")]) == 0
    r, s = (json.loads(p.read_text()) for p in (tmp_path / "r" / "replay_metrics.json", res.out_dir / "metrics.json"))
    assert r["optimizer_batch/final_adapter_sha256"] == s["optimizer_batch/final_adapter_sha256"]
    assert _sampler(res.replay_toml, capsys)["attribution"] == "truncation"
    # precision alone: bf16 sampling opens a gap that sampling in the model's dtype does not
    _, bf16 = _capture(trl_base, tmp_path / "bf16", monkeypatch, "bfloat16", 0)
    _, same = _capture(trl_base, tmp_path / "same", monkeypatch, "model", 0)
    gap, floor = (_sampler(x.replay_toml, capsys)["log_ratio"]["abs_max"] for x in (bf16, same))
    assert gap > 1e-3 and floor < 1e-4 and gap > 100 * floor, (gap, floor)
