"""The typed config tree: one frozen dataclass per TOML section, a docstring per field.

Precedence, written once: ``--set KEY=VALUE`` on the command line > the TOML file > the defaults
below.  Unknown keys are refused with their dotted path; invalid values with the allowed ones.
Field docs live in ``metadata["doc"]`` so ``docs/config.md`` and errors can quote them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from replayjob.errors import ConfigError


def doc(text: str, default: Any = None, **kw: Any) -> Any:
    """A dataclass field with its documentation attached."""
    if "default_factory" in kw:
        return field(default_factory=kw["default_factory"], metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


Trainer = Literal["grpo", "optimizer_replay"]
Estimator = Literal["grpo", "dr_grpo", "rloo"]
DType = Literal["float32", "bfloat16", "float16"]
SamplingDType = Literal["model", "bfloat16", "float16"]
MIN_TEMPERATURE = 1e-6  # logits up to 3e32 stay finite in float32 once divided by it


@dataclass(frozen=True)
class TrainingConfig:
    trainer: Trainer = doc("Which runner: 'grpo' (the source trainer) or 'optimizer_replay'.", "grpo")
    seed: int | None = doc("Seed for prompts, sampling and LoRA init; required (>= 0) under strict mode.",
                           None)
    max_steps: int = doc("Number of optimizer steps (>= 1). The step-zero capture and replay require exactly 1.", 1)
    save_every: int = doc("Write a resumable checkpoint every N steps; 0 disables checkpoints.", 0)
    micro_batch_size: int = doc("Rows per forward/backward micro-batch (systems-only knob).", 4)

    def __post_init__(self) -> None:
        if self.seed is not None and self.seed < 0:
            raise ConfigError("must be >= 0", where="training.seed")
        if self.max_steps < 1:
            raise ConfigError("must be >= 1", where="training.max_steps")
        if self.save_every < 0:
            raise ConfigError("must be >= 0 (0 disables checkpoints)", where="training.save_every")
        if self.micro_batch_size < 1:
            raise ConfigError("must be >= 1", where="training.micro_batch_size")


@dataclass(frozen=True)
class BackendOptions:
    strict_deterministic: bool = doc(
        "Establish strict PyTorch/cuDNN/cuBLAS determinism before any model exists; "
        "needs an explicit training.seed.", False)
    gradient_checkpointing: bool = doc("Recompute activations in backward (systems-only knob).", False)
    attn_implementation: Literal["eager", "sdpa"] = doc(
        "Attention kernel in the model config; strict mode requires 'eager'.", "eager")


@dataclass(frozen=True)
class BackendConfig:
    name: str = doc("Backend from the 'replayjob.backends' entry-point group; 'hf' is built in.", "hf")
    devices: str = doc("Exactly one device: 'cpu', 'cuda', 'cuda:N' or 'gpu:N'.", "cpu")
    options: BackendOptions = doc("Backend options.", default_factory=BackendOptions)

    def __post_init__(self) -> None:
        d = self.devices
        ok = d in ("cpu", "cuda") or re.fullmatch(r"(cuda|gpu):[0-9]{1,9}", d) is not None  # ASCII digits only
        if not ok:
            raise ConfigError(f"{d!r} is not a device; use 'cpu', 'cuda', 'cuda:N' or 'gpu:N' "
                              "(exactly one device)", where="backend.devices")

    @property
    def torch_device(self) -> str:
        return "cpu" if self.devices == "cpu" else self.devices.replace("gpu", "cuda")


@dataclass(frozen=True)
class InferenceConfig:
    engine: Literal["pytorch"] = doc("Sampling engine; 'pytorch' samples with the policy itself.", "pytorch")
    max_new_tokens: int = doc("Longest completion in tokens.", 8)
    temperature: float = doc("Sampling temperature (>= 1e-6: the logits divided by a smaller one leave "
                                      "float32's range).", 1.0)
    top_p: float = doc("Nucleus sampling: keep the most likely tokens whose probabilities first reach top_p, "
                       "renormalised; 1 keeps every token.", 1.0)
    top_k: int = doc("Keep only the top_k most likely tokens, renormalised; 0 keeps every token.", 0)
    sampling_dtype: SamplingDType = doc(
        "Precision of the sampler's forward: 'model' runs it in model.dtype; 'bfloat16' or 'float16' "
        "under torch.autocast, as a lower-precision inference engine does. The trainer's logprobs always "
        "run in model.dtype (docs/mismatch.md).", "model")

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError("must be >= 1", where="inference.max_new_tokens")
        if not self.temperature >= MIN_TEMPERATURE:
            raise ConfigError(f"must be >= {MIN_TEMPERATURE:g} (the logits divided by a smaller one leave float32's "
                              "range, and the sampler draws from infinities)", where="inference.temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("must be in (0, 1] (1 keeps every token)", where="inference.top_p")
        if self.top_k < 0:
            raise ConfigError("must be >= 0 (0 keeps every token)", where="inference.top_k")


@dataclass(frozen=True)
class ResumeConfig:
    from_: str = doc("Resume state directory (adapter + trainer_state.json); '' starts fresh.", "")


@dataclass(frozen=True)
class OptimizerBatchConfig:
    capture: bool = doc("Capture the optimizer batch of the single step (source runs).", False)
    replay_path: str = doc("Capture manifest to replay (optimizer_replay runs).", "")
    expected_logical_sha256: str = doc("Pinned logical-rows digest from the source run.", "")
    expected_manifest_sha256: str = doc("Pinned manifest digest from the source run.", "")
    allow_config_differences: list[str] = doc(
        "Dotted config keys allowed to differ from the source; each must be systems-only and present.",
        default_factory=list)
    arm: str = doc("Condition name for reports (printable ASCII: no control characters, no invisible or "
                   "direction-changing ones, no space at either end); '' derives it from the "
                   "declared differences.", "")
    tolerances_sha256: str = doc("SHA-256 of a predeclared tolerance file (approximate claim).", "")
    budgets_sha256: str = doc("SHA-256 of a predeclared budget file (reduce --budgets).", "")
    mismatch_bound_sha256: str = doc("SHA-256 of a predeclared mismatch bound file (mismatch --bound).", "")
    warmup_updates: int = doc(
        "Replay: in-process updates from the same restored state run and discarded after the measured "
        "fresh-process update.", 0)
    measured_updates: int = doc(
        "Replay: in-process updates from the same restored state measured after the warm-up ones "
        "(recorded apart from the fresh-process update).", 0)
    trace: bool = doc("Replay only: record a layer-level trace (per-module outputs and output gradients, "
                      "parameter gradients and updates) into trace/ beside replay_metrics.json "
                      "(docs/trace-format.md); same as replay --trace.", False)
    capture_steps: list[int] = doc(
        "Source runs of any length: 0-based steps whose optimizer batch, adapter, optimizer state and "
        "learning rate are captured (optimizer_batch_step_<K>.*, replay_step_<K>.toml).", default_factory=list)
    ring_size: int = doc("Source runs: keep the last N steps (rows and state) in host memory and write them "
                         "when a trigger fires; 0 turns the ring buffer off.", 0)
    ring_grad_norm_above: float = doc("Ring trigger: gradient norm above this value; 0 turns it off "
                                      "(a non-finite loss or gradient norm always triggers).", 0.0)
    ring_grad_norm_median_multiple: float = doc(
        "Ring trigger: gradient norm above this multiple of the running median of earlier steps; 0: off.", 0.0)
    ring_loss_spike_multiple: float = doc(
        "Ring trigger: |loss| above this multiple of the running median |loss| of earlier steps; 0: off.", 0.0)
    allow_nonfinite_inputs: bool = doc(
        "Replay runs: admit a capture whose manifest flags non-finite inputs (refused otherwise).", False)
    routing_path: str = doc(
        "Replay with model.routing = 'forced': the routing evidence whose experts the forward uses (a source "
        "run's routing_step_<K>.safetensors or a replay's routing.safetensors; docs/moe.md).", "")
    routing_sha256: str = doc("SHA-256 pin of optimizer_batch.routing_path (required with it).", "")

    def __post_init__(self) -> None:
        steps = self.capture_steps
        if any(k < 0 for k in steps) or len(set(steps)) != len(steps):
            raise ConfigError(f"must list distinct steps >= 0, found {steps}",
                              where="optimizer_batch.capture_steps")
        if self.ring_size < 0:
            raise ConfigError("must be >= 0 (0 turns the ring buffer off)", where="optimizer_batch.ring_size")
        for name in ("ring_grad_norm_above", "ring_grad_norm_median_multiple", "ring_loss_spike_multiple"):
            if not 0.0 <= getattr(self, name) < float("inf"):
                raise ConfigError("must be a finite number >= 0 (0 turns the trigger off)",
                                  where=f"optimizer_batch.{name}")
        if self.warmup_updates < 0 or self.measured_updates < 0:
            raise ConfigError("must be >= 0", where="optimizer_batch.warmup_updates/measured_updates")
        if self.warmup_updates and not self.measured_updates:
            raise ConfigError("warm-up updates without measured ones measure nothing",
                              where="optimizer_batch.warmup_updates",
                              hint="set optimizer_batch.measured_updates >= 1 too")


@dataclass(frozen=True)
class ModelConfig:
    path: str = doc("Local model directory (safetensors weights); '' builds the built-in tiny model.", "")
    init_seed: int = doc("Seed for the built-in model's random weights.", 1234)
    dtype: DType = doc("Parameter dtype of the base model and adapter.", "float32")
    hidden_size: int = doc("Built-in model: hidden size.", 64)
    intermediate_size: int = doc("Built-in model: MLP size.", 128)
    num_layers: int = doc("Built-in model: decoder layers.", 2)
    num_heads: int = doc("Built-in model: attention heads.", 4)
    num_kv_heads: int = doc("Built-in model: key/value heads.", 2)
    max_position_embeddings: int = doc("Built-in model: longest sequence.", 128)
    architecture: Literal["llama", "qwen3_moe"] = doc(
        "Built-in model: 'llama' (dense) or 'qwen3_moe' (mixture of experts, transformers' Qwen3-MoE classes; "
        "docs/moe.md).", "llama")
    num_experts: int = doc("Built-in MoE model: experts per MoE layer (>= 2).", 4)
    num_experts_per_tok: int = doc("Built-in MoE model: experts each token is routed to (top-k, < num_experts).", 2)
    moe_intermediate_size: int = doc("Built-in MoE model: each expert's MLP size.", 64)
    routing: Literal["free", "forced"] = doc(
        "MoE models: 'free' routes each token to the router's top-k experts; 'forced' (replays only) uses the "
        "experts recorded in optimizer_batch.routing_path, the weights recomputed from the live router logits "
        "(systems-only knob; docs/moe.md).", "free")
    experts_implementation: Literal["eager", "batched_mm", "grouped_mm"] = doc(
        "MoE models: transformers' experts kernel (a loop over experts, batched or grouped matmul; "
        "systems-only knob).", "eager")
    router_aux_loss_coef: float = doc(
        "MoE models: coefficient of the load-balancing router loss (transformers' load_balancing_loss_func over "
        "each micro-batch's real tokens) added to each micro-batch's loss; 0 disables it. Part of the optimizer "
        "contract; with it on, micro-batches and ranks cannot be regrouped (docs/moe.md).", 0.0)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "max_position_embeddings", "moe_intermediate_size"):
            if getattr(self, name) < 1:
                raise ConfigError("must be >= 1", where=f"model.{name}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ConfigError("hidden_size must divide by num_heads, num_heads by num_kv_heads",
                              where="model")
        if not 0.0 <= self.router_aux_loss_coef < float("inf"):
            raise ConfigError("must be a finite number >= 0 (0 disables it)", where="model.router_aux_loss_coef")
        if not 1 <= self.num_experts_per_tok < self.num_experts:
            raise ConfigError(f"must be in [1, num_experts) (num_experts = {self.num_experts}): a router that "
                              "picks every expert has nothing to route", where="model.num_experts_per_tok")


@dataclass(frozen=True)
class LoraConfig:
    r: int = doc("LoRA rank.", 8)
    alpha: int = doc("LoRA scaling numerator (scale = alpha / r).", 16)
    dropout: float = doc("LoRA dropout; uses the Torch RNG that capture records.", 0.0)
    target_modules: list[str] = doc("Module names that get adapters.",
                                    default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ConfigError("must be >= 1", where="lora.r")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("must be in [0, 1)", where="lora.dropout")
        if not self.target_modules:
            raise ConfigError("must name at least one module", where="lora.target_modules")


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["adamw"] = doc("Optimizer.", "adamw")
    lr: float = doc("Learning rate.", 1e-3)
    betas: list[float] = doc("AdamW betas.", default_factory=lambda: [0.9, 0.999])
    eps: float = doc("AdamW epsilon (>= 0).", 1e-8)
    weight_decay: float = doc("AdamW decoupled weight decay (>= 0).", 0.0)
    max_grad_norm: float = doc("Clip the global gradient norm to this; 0 disables clipping.", 1.0)

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError("must be > 0", where="optimizer.lr")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("must be two numbers in [0, 1)", where="optimizer.betas")
        for name in ("eps", "weight_decay"):  # torch's AdamW refuses a negative one when it is built
            if getattr(self, name) < 0:
                raise ConfigError("must be >= 0", where=f"optimizer.{name}")
        if self.max_grad_norm < 0:
            raise ConfigError("must be >= 0", where="optimizer.max_grad_norm")


@dataclass(frozen=True)
class AlgorithmConfig:
    estimator: Estimator = doc("Advantage estimator: 'grpo', 'dr_grpo' (no std) or 'rloo'.", "grpo")
    prompts_per_step: int = doc("Prompts sampled per step.", 4)
    group_size: int = doc("Completions per prompt (G).", 4)
    std_eps: float = doc("Added to the group std in GRPO normalisation.", 1e-6)
    clip_eps_low: float = doc("PPO ratio clip below 1.", 0.2)
    clip_eps_high: float = doc("PPO ratio clip above 1.", 0.2)
    kl_loss_coef: float = doc("Coefficient of the k3 KL-to-reference term in the loss; 0 disables it.", 0.0)
    kl_reward_coef: float = doc("Coefficient of the per-token k1 KL penalty in the advantage.", 0.0)
    batch_adv_norm: bool = doc("Normalise advantages over the whole batch after estimation.", False)
    adv_clip: float = doc("Clip advantages to [-c, c]; 0 disables.", 0.0)
    token_cap: int = doc("Cap on response tokens per batch that carry loss weight; 0 disables.", 0)
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = doc("How token losses are averaged.",
                                                                 "token-mean")
    logprob_temperature: Literal["sampling", "none"] = doc(
        "The trainer's logprobs (old, reference and the loss's): 'sampling' divides the logits by "
        "inference.temperature, as the sampler does; 'none' does not, as releases before this setting did "
        "(consistent with the sampler only at temperature 1; docs/mismatch.md).", "sampling")

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1:
            raise ConfigError("must be >= 1", where="algorithm.prompts_per_step")
        if self.group_size < 2:
            raise ConfigError("must be >= 2 (group baselines need two samples)",
                              where="algorithm.group_size")
        for name in ("clip_eps_low", "clip_eps_high", "kl_loss_coef", "kl_reward_coef", "adv_clip",
                     "std_eps"):
            if getattr(self, name) < 0:
                raise ConfigError("must be >= 0", where=f"algorithm.{name}")
        if self.token_cap < 0:
            raise ConfigError("must be >= 0 (0 disables)", where="algorithm.token_cap")


@dataclass(frozen=True)
class EnvironmentConfig:
    task: Literal["arithmetic", "reverse"] = doc("Built-in verifiable toy task.", "arithmetic")
    max_operand: int = doc("Largest operand (arithmetic) or string length (reverse).", 99)
    nondeterministic_observation: bool = doc(
        "Put a wall-clock timestamp into every prompt, so same-seed runs differ.", False)

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ConfigError("must be >= 1", where="environment.max_operand")


Strategy = Literal["none", "ddp", "fsdp2"]


@dataclass(frozen=True)
class DistributedConfig:
    strategy: Strategy = doc(
        "How the ranks torchrun launches share one update: 'none' (one process, no process group), 'ddp' "
        "(DistributedDataParallel, gradients summed over ranks) or 'fsdp2' (fully_shard: parameters, gradients "
        "and optimizer state sharded over ranks) "
        "(systems-only knob).", "none")
    world_size: int | None = doc(
        "Ranks sharing the update, observed from the launcher (torchrun's WORLD_SIZE; 1 without one) and "
        "recorded; a declared value that contradicts the launcher is refused (systems-only knob).", None)
    bucket_cap_mb: float = doc("DDP gradient bucket size in MiB (systems-only knob).", 25.0)
    timeout_s: float = doc("Process-group timeout: a rank that waits longer for another fails (exit 3) "
                           "instead of hanging.", 600.0)

    def __post_init__(self) -> None:
        if self.world_size is not None and self.world_size < 1:
            raise ConfigError("must be >= 1", where="distributed.world_size")
        if not self.bucket_cap_mb > 0:
            raise ConfigError("must be > 0", where="distributed.bucket_cap_mb")
        if not self.timeout_s > 0:
            raise ConfigError("must be > 0", where="distributed.timeout_s")


@dataclass(frozen=True)
class LoggingConfig:
    dir: str = doc("Output directory when --out is not given.", "runs/latest")
    run_name: str = doc("Free-form run name recorded in metrics.", "")
    metadata: dict[str, str] = doc("Free-form string labels recorded (redacted) in metrics.",
                                   default_factory=dict)


@dataclass(frozen=True)
class Config:
    training: TrainingConfig = doc("[training]", default_factory=TrainingConfig)
    backend: BackendConfig = doc("[backend]", default_factory=BackendConfig)
    inference: InferenceConfig = doc("[inference]", default_factory=InferenceConfig)
    resume: ResumeConfig = doc("[resume]", default_factory=ResumeConfig)
    optimizer_batch: OptimizerBatchConfig = doc("[optimizer_batch]", default_factory=OptimizerBatchConfig)
    model: ModelConfig = doc("[model]", default_factory=ModelConfig)
    lora: LoraConfig = doc("[lora]", default_factory=LoraConfig)
    optimizer: OptimizerConfig = doc("[optimizer]", default_factory=OptimizerConfig)
    algorithm: AlgorithmConfig = doc("[algorithm]", default_factory=AlgorithmConfig)
    environment: EnvironmentConfig = doc("[environment]", default_factory=EnvironmentConfig)
    logging: LoggingConfig = doc("[logging]", default_factory=LoggingConfig)
    distributed: DistributedConfig = doc("[distributed]", default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        if self.backend.options.strict_deterministic:
            if self.training.seed is None:
                raise ConfigError("strict_deterministic needs an explicit non-negative seed",
                                  where="training.seed", hint="set training.seed = 123 (any integer >= 0)")
            if self.backend.options.attn_implementation != "eager":
                raise ConfigError("strict_deterministic requires the eager attention implementation",
                                  where="backend.options.attn_implementation")


# TOML spells some keys differently from Python identifiers.
TOML_NAMES = {"from_": "from"}
