"""The tests' GRPO scenario with GRPOConfig's own defaults where the shared one (conftest.grpo) fixes them: a tiny
Qwen2 (conftest.build_base), LoRA without dropout, one capture of a chosen step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from conftest import reward

from replayjob.producers.trl.producer import capture_optimizer_batch

# The micro-batch arm of the tests' TRL captures (per_device_train_batch_size 4, here and in conftest.grpo): the size
# halved, declared.
MICRO = ["--set", "trl.per_device_train_batch_size=2",
         "--set", 'optimizer_batch.allow_config_differences=["trl.per_device_train_batch_size"]']


def capture(base: Path, out: Path, *, step: int = 2, **config: Any) -> Any:
    """The tests' GRPO scenario (LoRA dropout 0) with GRPOConfig's own precision default unless ``config`` sets it;
    step ``step`` captured."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    kw = {"output_dir": str(out / "trainer"), "per_device_train_batch_size": 4, "num_generations": 4,
          "gradient_accumulation_steps": 2, "num_iterations": 2, "beta": 0.04, "max_completion_length": 6,
          "max_steps": 3, "logging_steps": 1, "report_to": [], "use_cpu": True, "seed": 7, "save_strategy": "no",
          "learning_rate": 1e-2, "disable_tqdm": True, "loss_type": "grpo", **config}
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**kw),
                          train_dataset=Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(16)]}),
                          processing_class=AutoTokenizer.from_pretrained(base),
                          peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 target_modules=["q_proj", "v_proj"]))
    handle = capture_optimizer_batch(trainer, out, step=step)
    trainer.train()
    return handle.result
