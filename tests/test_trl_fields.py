"""Every field of the installed TRL's GRPOConfig and RLOOConfig is classified in one table
(replayjob/producers/trl/fields.py), and that table drives the contract, the replay's trainer, the refusals of
explain and replay, the knobs and docs/trl-fields.md.  A capture made with two reward functions and
``reward_weights`` is admitted and replayed bitwise (the update reads the captured advantages, not the rewards).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl", reason="the TRL tests need the 'trl' extra: pip install -e '.[trl]'")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch
from conftest import REPO, reward

from replayjob.cli import main
from replayjob.digest import sha256_bytes, sha256_json
from replayjob.jsonio import canonical_bytes
from replayjob.producers.trl import fields as tf
from replayjob.producers.trl import producer as trl_mod
from replayjob.runtime import knobs

pytestmark = pytest.mark.usefixtures("fresh_determinism_mode")


def _installed_fields() -> set[str]:
    import trl

    return {f.name for c in tf.CONFIGS for f in dataclasses.fields(getattr(trl, c))}


def test_every_installed_field_is_classified_once() -> None:
    """A field a new TRL adds fails here until it is classified; a field it drops is a stale entry."""
    assert tf.unclassified(_installed_fields()) == []
    assert sorted(set(tf.FIELDS) - _installed_fields()) == []
    assert {f.kind for f in tf.FIELDS.values()} == set(tf.KINDS)
    assert all(f.reason for f in tf.FIELDS.values())
    assert all(f.allowed for f in tf.FIELDS.values() if f.kind == tf.REFUSED)
    # the check itself: a field missing from the table is reported by name
    assert tf.unclassified({*_installed_fields(), "some_new_loss_coef"}) == ["some_new_loss_coef"]


def test_the_tables_knobs_are_the_registered_trl_knobs() -> None:
    """Each knob field is a registered knob of TRL (the activation_checkpointing* names are transformers' new names
    of the same settings, the kwargs field is addressed by its use_reentrant key), and every registered trl.* knob
    is a knob field of the table."""
    registered = {k for k in knobs.knobs_for("trl") if k.startswith("trl.")}
    named = {trl_mod.KNOB_ALIASES.get(n, n) for n in tf.fields_of(tf.KNOB)}
    as_keys = {f"trl.{n}" + (".use_reentrant" if n.endswith("_kwargs") else "") for n in named}
    assert as_keys == registered


def test_the_contract_is_the_tables_contract_fields() -> None:
    """Changing any contract field changes the contract; changing an irrelevant field does not; the fields that
    change the loss outside the old list (the MoE auxiliary loss, the temperature of the fused LM head, dr_grpo's
    max_completion_length) are in it."""
    base = {n: 0 for n in tf.FIELDS}
    resolved = {"trl": base, "model": {"dtype": "float32"}, "peft": {}}
    c0 = trl_mod.contract(resolved)
    for name in tf.contract_fields(base):
        changed = trl_mod.contract({**resolved, "trl": {**base, name: 1}})
        assert changed != c0, name
    for name in tf.fields_of(tf.IRRELEVANT):
        assert trl_mod.contract({**resolved, "trl": {**base, name: 1}}) == c0, name
    assert {"router_aux_loss_coef", "temperature", "max_completion_length"} <= set(c0["update"])
    vllm = trl_mod.contract({**resolved, "trl": {**base, "use_vllm": True}})
    assert "vllm_importance_sampling_correction" in vllm["update"] and "use_vllm" not in c0["update"]


def test_the_docs_page_is_generated_from_the_table() -> None:
    text = (REPO / "docs" / "trl-fields.md").read_text(encoding="utf-8")
    assert text == tf.markdown(), "regenerate: python -m replayjob.producers.trl.fields > docs/trl-fields.md"
    for name in tf.FIELDS:
        assert f"| `{name}` |" in text


def _rewritten(res: Any, d: Path, **trl: Any) -> list[str]:
    """A copy of the capture whose manifest records other GRPOConfig values, its digests recomputed (contract by the
    producer's own function); the --set pins of a replay of the copy."""
    shutil.copytree(res.out_dir, d, ignore=shutil.ignore_patterns("trainer"))
    name = res.manifest.name
    doc = json.loads((d / name).read_text())
    doc["config"]["resolved"]["trl"].update(trl)
    doc["config"]["sha256"] = sha256_json(doc["config"]["resolved"])
    doc["contract"]["value"] = trl_mod.contract(doc["config"]["resolved"])
    doc["contract"]["sha256"] = sha256_json(doc["contract"]["value"])
    data = canonical_bytes(doc) + b"\n"
    (d / name).write_bytes(data)
    return ["--set", f'optimizer_batch.replay_path="{d / name}"',
            "--set", f'optimizer_batch.expected_manifest_sha256="{sha256_bytes(data)}"']


@pytest.mark.parametrize(("field", "value"), [("neftune_noise_alpha", 5.0), ("use_liger_kernel", True),
                                               ("deepspeed", "ds.json")])
def test_a_capture_setting_a_refused_field_is_refused(field: str, value: Any, trl_capture: dict[str, Any],
                                                      tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sets = _rewritten(trl_capture["result"], tmp_path / "cap", **{field: value})
    capsys.readouterr()
    assert main(["explain", str(trl_capture["result"].replay_toml), *sets]) == 2
    err = capsys.readouterr()
    text = err.out + err.err
    assert f"trl.{field} = {value!r} is not replayed" in text and "Traceback" not in text, text
    assert main(["replay", str(trl_capture["result"].replay_toml), "--out", str(tmp_path / "r"), *sets]) == 2
    assert not (tmp_path / "r" / "replay_metrics.json").exists()


def test_an_override_of_an_irrelevant_field_says_so(trl_capture: dict[str, Any],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """explain reads the table: an override of a logging field is refused as a difference, and named irrelevant to
    the update (the replay would run TRL's default for it), not as a key that may change the math only."""
    capsys.readouterr()
    assert main(["explain", str(trl_capture["result"].replay_toml), "--set", "trl.logging_steps=5"]) == 2
    err = capsys.readouterr().err
    assert "trl.logging_steps is irrelevant to the update (logging:" in err and "remove the override" in err, err


def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(len(c) % 4) for c in completions]


@pytest.mark.slow
def test_two_reward_functions_with_weights_are_admitted_and_replayed_bitwise(trl_base: Path, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from replayjob.producers.trl.producer import capture_optimizer_batch

    model = AutoModelForCausalLM.from_pretrained(trl_base, dtype=torch.float32, attn_implementation="eager")
    args = GRPOConfig(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=4, num_generations=4,
                      gradient_accumulation_steps=2, beta=0.04, max_completion_length=6, max_steps=2,
                      logging_steps=1, report_to=[], use_cpu=True, seed=7, save_strategy="no", learning_rate=1e-2,
                      bf16=False, disable_tqdm=True, reward_weights=[1.0, 0.5])
    trainer = GRPOTrainer(model=model, reward_funcs=[reward, length_reward], args=args,
                          train_dataset=Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(16)]}),
                          processing_class=AutoTokenizer.from_pretrained(trl_base),
                          peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "v_proj"]))
    handle = capture_optimizer_batch(trainer, tmp_path / "cap", step=1)
    trainer.train()
    res = handle.result
    assert json.loads(res.manifest.read_text())["config"]["resolved"]["trl"]["reward_weights"] == [1.0, 0.5]
    assert main(["explain", str(res.replay_toml)]) == 0
    assert main(["replay", str(res.replay_toml), "--out", str(tmp_path / "r")]) == 0, capsys.readouterr().err
    r = json.loads((tmp_path / "r" / "replay_metrics.json").read_text())
    s = json.loads((res.out_dir / "metrics.json").read_text())
    assert r["optimizer_batch/final_adapter_sha256"] == s["optimizer_batch/final_adapter_sha256"]
    assert r["loss"] == s["loss"] and r["grad_norm"] == s["grad_norm"]
