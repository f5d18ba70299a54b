"""A tiny verl setup on CPU, shared by tests/test_verl.py and benchmarks/verl_capture_overhead.py.

A random-init two-layer Qwen2 built from a config (nothing downloaded), verl 0.9.1's actor ``TrainingWorker``
built as ``ActorRolloutRefWorker.init_model`` builds it (on the CPU through
:mod:`replayjob.producers.verl.platform`), a driver shaped like ``RayPPOTrainer._update_actor(batch)`` (the
same ``DataProto`` -> no-padding ``TensorDict`` conversion and settings, handed to the worker's
``train_mini_batch`` in-process instead of through Ray), and the padded batch verl's driver holds after rollout.
Needs verl (``pip install -e '.[verl]'``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from replayjob.producers.verl.platform import use_cpu

ROWS, PROMPT, RESPONSE = 8, 5, 6
# verl's FSDP engine computes in bfloat16 unless mixed_precision says otherwise (its default param_dtype, with
# autocast); a knob's rule is checked at float32, where rounding is far below the tolerance
FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def tiny_model(d: Path) -> Path:
    """A random-init two-layer Qwen2 saved as safetensors (no download)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if not (d / "config.json").exists():
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=False)
        Qwen2ForCausalLM(cfg).save_pretrained(d)
    return d


def build_worker(base: Path, *, loss_mode: str = "vanilla", agg: str = "token-mean", lora: int = 0,
                 remove_padding: bool = True, micro: int = 2, mini: int = 4, epochs: int = 1,
                 entropy: float = 0.0, kl: bool = False, fp32: bool = False) -> Any:
    """verl's actor TrainingWorker built as ActorRolloutRefWorker.init_model builds it (its engine-config
    assignments included), on the CPU."""
    from verl.workers.config import (
        FSDPActorConfig,
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        TrainingWorkerConfig,
    )
    from verl.workers.config.actor import PolicyLossConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    use_cpu()
    model = HFModelConfig(path=str(base), load_tokenizer=False, use_remove_padding=remove_padding,
                          enable_gradient_checkpointing=False, lora_rank=lora, lora_alpha=8,
                          override_config={"attn_implementation": "sdpa"})
    actor = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=mini, ppo_micro_batch_size_per_gpu=micro,
                            ppo_epochs=epochs, rollout_n=1, loss_agg_mode=agg, entropy_coeff=entropy,
                            use_kl_loss=kl, kl_loss_coef=0.01, policy_loss=PolicyLossConfig(loss_mode=loss_mode),
                            optim=FSDPOptimizerConfig(lr=1e-2, total_training_steps=6, lr_warmup_steps=0,
                                                            lr_scheduler_type="cosine"),
                            fsdp_config=FSDPEngineConfig(dtype="float32", mixed_precision=FP32 if fp32 else None),
                            use_remove_padding=remove_padding)
    actor.model_config = model
    cfg = TrainingWorkerConfig(model_type="language_model", model_config=model, engine_config=actor.engine,
                               optimizer_config=actor.optim, checkpoint_config=actor.checkpoint)
    cfg.engine_config.use_dynamic_bsz = False
    cfg.engine_config.micro_batch_size_per_gpu = micro
    cfg.engine_config.infer_micro_batch_size_per_gpu = micro  # the log-prob pass (ppo_infer_micro_batch_size_per_gpu)
    cfg.engine_config.use_remove_padding = remove_padding
    with verl_worker_env():
        worker = TrainingWorker(cfg)
    worker.reset()
    worker.set_loss_fn(functools.partial(ppo_loss, config=actor))
    return worker


@contextlib.contextmanager
def verl_worker_env() -> Iterator[None]:
    """The rank variables verl's Worker reads (a Ray worker has them; under torchrun the launcher's are kept), set
    for its construction only: verl's Worker writes them into os.environ, and the replays later in this process
    are not launched processes."""
    saved = dict(os.environ)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class TinyTrainer:
    """``RayPPOTrainer._update_actor(batch)`` in one process: the same DataProto -> no-padding TensorDict
    conversion and settings, handed to the actor worker's ``train_mini_batch``."""

    def __init__(self, worker: Any, *, mini: int = 4, epochs: int = 1, temperature: float = 1.0,
                 sampler_noise: float | None = None):
        self.worker, self.mini, self.epochs, self.temperature = worker, mini, epochs, temperature
        self.sampler_noise = sampler_noise

    def _compute_old_log_prob(self, batch: Any) -> Any:
        """``RayPPOTrainer._compute_old_log_prob``: the actor's logprobs of the batch by the worker's ``infer_batch``
        (the driver's conversion to no-padding and back, as verl does it)."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

        td = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
        out = self.worker.infer_batch(td)
        return no_padding_2_padding(tu.get(out, "log_probs"), td).float()

    def _update_actor(self, batch: Any) -> dict[str, Any]:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        batch.meta_info["multi_turn"] = False
        batch.meta_info["temperature"] = self.temperature
        if self.sampler_noise is not None:  # a run with calculate_log_probs: the actor's old logprobs, and the
            # rollout's (a sampler whose numerics differ from the trainer's by a known seeded perturbation)
            old = self._compute_old_log_prob(batch)
            g = torch.Generator().manual_seed(len(batch))
            noise = torch.randn(old.shape, generator=g) * self.sampler_noise
            batch.batch["old_log_probs"] = old
            batch.batch["rollout_log_probs"] = (old + noise) * batch.batch["response_mask"]
        td = left_right_2_no_padding(batch.to_tensordict())
        cfg = self.worker.loss_fn.keywords["config"]
        tu.assign_non_tensor(td, calculate_entropy=cfg.calculate_entropy or cfg.entropy_coeff != 0.0,
                             distillation_use_topk=False, distillation_only=False, global_batch_size=self.mini,
                             mini_batch_size=self.mini, epochs=self.epochs, seed=cfg.data_loader_seed,
                             dataloader_kwargs={"shuffle": cfg.shuffle}, compute_loss=True)
        world = torch.distributed.get_world_size()
        if world > 1:  # verl's dispatch hands each data-parallel rank its contiguous share of the batch
            td = tu.chunk_tensordict(td, world)[torch.distributed.get_rank()]
        out = self.worker.train_mini_batch(td)
        return dict(tu.get(out, "metrics"))


def rollout_batch(seed: int) -> Any:
    """A batch as verl's driver holds it after rollout and advantage estimation: left-padded prompts, right-padded
    responses, old and reference logprobs, advantages."""
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, 96, (ROWS, PROMPT), generator=g)
    responses = torch.randint(1, 96, (ROWS, RESPONSE), generator=g)
    pmask = torch.ones(ROWS, PROMPT, dtype=torch.long)
    rmask = torch.ones(ROWS, RESPONSE, dtype=torch.long)
    for r in range(ROWS):
        pmask[r, : r % 3] = 0
        rmask[r, RESPONSE - (r % 4):] = 0
    attn = torch.cat([pmask, rmask], 1)
    return DataProto.from_dict(tensors={
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attn,
        "position_ids": torch.clamp(torch.cumsum(attn, 1) - 1, min=0), "prompts": prompts, "responses": responses,
        "response_mask": rmask.float(), "old_log_probs": -torch.rand(ROWS, RESPONSE, generator=g) * 4,
        "ref_log_prob": -torch.rand(ROWS, RESPONSE, generator=g) * 4,
        "advantages": torch.randn(ROWS, RESPONSE, generator=g)})


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.verl_tiny OUT BASE STEP`` (under ``torchrun --nproc-per-node N`` for N data-parallel
    processes): two updates of a vanilla float32 run, optimizer step STEP captured into OUT."""
    import sys

    from replayjob.producers.verl.producer import capture_actor_steps

    out, base, step = (argv if argv is not None else sys.argv[1:])[:3]
    worker = build_worker(tiny_model(Path(base)), fp32=True)
    capture = capture_actor_steps(worker, out, step=int(step))
    trainer = TinyTrainer(worker)
    for u in range(2):
        trainer._update_actor(rollout_batch(100 + u))
    print(f"captured {capture.result.manifest} on rank {torch.distributed.get_rank()}")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
