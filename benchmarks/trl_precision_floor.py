"""The noise floor of a TRL update per loss type and compute precision: how far a systems-only change moves it.

For each loss type (``grpo``, ``dr_grpo``, ``dapo``) and precision (``fp32``: ``bf16=False``; ``bf16``:
GRPOConfig's default ``bf16=True``, bf16 autocast on CPU), a real GRPOTrainer run (a tiny Qwen2 built from a
config, LoRA, dropout 0, gradient accumulation 2) captures step 2; the capture is replayed as its baseline and as
two systems-only arms whose exact arithmetic is the baseline's (micro-batches of 2 rows, ``sdpa`` attention).
Each arm's adapter update is compared with the baseline's: relative L2 distance and 1 - cosine.  That is the floor
below which an approximate claim cannot tell a systems change from rounding, per loss type and precision.

Ratio: the largest relative L2 distance of any arm divided by the tolerance the capture's recorded precision
suggests (:func:`replayjob.producers.api.precision.suggested_tolerances`); target <= 1: the suggested tolerance
holds every measured floor.  docs/precision.md reports the figures.

Run: ``python -m benchmarks.trl_precision_floor [--smoke] [--hidden N]`` (``--smoke``: one loss type, one arm).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
PRECISIONS = {"fp32": False, "bf16": True}
ARMS = {"micro2": ["--set", "trl.per_device_train_batch_size=2",
                   "--set", 'optimizer_batch.allow_config_differences=["trl.per_device_train_batch_size"]'],
        "sdpa": ["--set", 'model.attn_implementation="sdpa"',
                 "--set", 'optimizer_batch.allow_config_differences=["model.attn_implementation"]']}


def build_base(d: Path, hidden: int) -> Path:
    """A tiny Qwen2 from a config and a character-level tokenizer, saved to ``d`` (nothing fetched)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<pad>": 0, "<eos>": 1, **{chr(c): i + 2 for i, c in enumerate(range(32, 127))}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)
    Qwen2ForCausalLM(cfg).save_pretrained(d)
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(d)
    return d


def reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A reward that varies within a group (so advantages are non-zero); the tests' TRL scenario uses it too."""
    return [float(c.count("1")) + 0.5 * (len(c) % 3) for c in completions]


def capture(base: Path, out: Path, loss_type: str, bf16: bool) -> Any:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from replayjob.producers.trl.producer import capture_optimizer_batch

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    args = GRPOConfig(output_dir=str(out / "trainer"), per_device_train_batch_size=4, num_generations=4,
                      gradient_accumulation_steps=2, num_iterations=2, beta=0.04, max_completion_length=6,
                      max_steps=3, logging_steps=1, report_to=[], use_cpu=True, seed=7, save_strategy="no",
                      learning_rate=1e-2, disable_tqdm=True, loss_type=loss_type, bf16=bf16,
                      gradient_checkpointing=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(16)]}),
                          processing_class=AutoTokenizer.from_pretrained(base),
                          peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "v_proj"]))
    handle = capture_optimizer_batch(trainer, out, step=2)
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer's log lines; the benchmark prints one
        trainer.train()
    return handle.result


def _update(d: Path, initial: dict[str, Any]) -> Any:
    import torch
    from safetensors.torch import load_file

    final = load_file(str(d / "final_adapter" / "adapter_model.safetensors"))
    return torch.cat([(final[n].double() - initial[n].double()).reshape(-1) for n in sorted(initial)])


def _replay(toml: Path, out: Path, sets: list[str]) -> None:
    from replayjob.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["replay", str(toml), "--out", str(out), *sets])
    if code != 0:
        raise RuntimeError(f"replay {out.name} exited {code}")


def floors(tmp: Path, base: Path, loss_type: str, name: str, arms: dict[str, list[str]]) -> dict[str, Any]:
    """One capture at one precision, its baseline and each arm: the arms' distances and the recorded precision."""
    import torch
    from safetensors.torch import load_file

    from replayjob.producers.api import precision

    res = capture(base, tmp / f"{loss_type}-{name}", loss_type, PRECISIONS[name])
    manifest = json.loads(res.manifest.read_text())
    recorded = manifest["framework_state"]["precision"]
    initial = load_file(str(res.manifest.with_name(res.manifest.name.replace(".manifest.json",
                                                                             ".adapter.safetensors"))))
    _replay(res.replay_toml, res.out_dir / "r-baseline", [])
    b = _update(res.out_dir / "r-baseline", initial)
    out: dict[str, Any] = {"compute_dtype": recorded["compute_dtype"],
                           "suggested": precision.suggested_tolerances(recorded), "arms": {}}
    for arm, sets in arms.items():
        _replay(res.replay_toml, res.out_dir / f"r-{arm}", sets)
        a = _update(res.out_dir / f"r-{arm}", initial)
        out["arms"][arm] = {"relative_delta_l2": float((a - b).norm() / b.norm()),
                            "one_minus_cosine": 1.0 - float(torch.nn.functional.cosine_similarity(a, b, dim=0))}
    return out


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=32, help="the tiny model's hidden size (the tests' scenario: 32)")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    losses = LOSS_TYPES[:1] if a.smoke else LOSS_TYPES
    arms = {"micro2": ARMS["micro2"]} if a.smoke else ARMS
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="replayjob-precision-") as d:
        tmp = Path(d)
        base = build_base(tmp / "base", a.hidden)
        for loss_type in losses:
            results[loss_type] = {name: floors(tmp, base, loss_type, name, arms) for name in PRECISIONS}
    used = max(arm["relative_delta_l2"] / r["suggested"]["relative_delta_l2_max"]
               for per in results.values() for r in per.values() for arm in r["arms"].values())
    target = common.Target("<=", 1.0, used)
    detail = "; ".join(
        f"{lt} " + ", ".join(f"{name} {max(x['relative_delta_l2'] for x in r['arms'].values()):.2e}"
                             for name, r in per.items()) for lt, per in results.items())
    print(common.summary_line("trl_precision_floor", used, target, f"largest arm relative L2 per loss type: {detail}",
                              smoke=a.smoke))
    common.write_result("trl_precision_floor", smoke=a.smoke, results=a.results, ratio_value=used,
                        ratio_definition="largest relative L2 distance of a systems-only arm's adapter update from "
                        "the baseline's, over the tolerance the capture's recorded precision suggests",
                        baseline="the same capture's baseline replay", target=target, measurements=results,
                        parameters={"hidden": a.hidden, "loss_types": list(losses), "arms": list(arms)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
