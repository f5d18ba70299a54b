"""Every field of verl's actor, engine, optimizer and model config dataclasses, classified once.

A verl capture records the settings of the actor update as four sections of the framework config
(``verl.actor``, ``verl.engine``, ``verl.optim``, ``verl.model``), read from the live objects of the
worker that ran the step: the loss's ``FSDPActorConfig``, the engine's ``FSDPEngineConfig``,
``FSDPOptimizerConfig`` and ``HFModelConfig``.  Each field is one of:

* **contract**: it defines the math of the update; recorded, part of the contract, and any difference
  at replay is refused unless it is a registered knob;
* **knob**: a systems-only setting registered in :mod:`replayjob.runtime.knobs` (``verl.<section>.<field>``),
  with the rule under which it may differ;
* **irrelevant**: it cannot change the captured optimizer step (with the reason); not recorded;
* **refused**: a capture is refused unless the field holds an admitted value (with the reason); the
  admitted value is recorded and part of the contract.

A knob also declares the values it takes (``valid``, described by ``takes``): a flag is a bool, a size a positive
integer or null, the precision table its three entries named as verl names a dtype.  :func:`value_reason` is the
one rule a capture records a field by and :func:`config_reasons` the one rule a replay's admission reads the
recorded ``verl`` section by (exactly the recorded fields of each section, each a value its class admits): a
re-pinned manifest whose section names an irrelevant or unknown field (``model.external_lib``, a module verl
imports), holds a refused value (``model.trust_remote_code = true``) or a knob of another type is refused before
any engine is built.

:data:`FIELDS` is a declaration a test walks: every field of the installed verl's dataclasses must be
listed here, so a verl release that adds a field fails that test (and a capture refuses a config with an
unclassified field) until someone classifies it.  This module imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CONTRACT, KNOB, IRRELEVANT, REFUSED = "contract", "knob", "irrelevant", "refused"
KINDS = (CONTRACT, KNOB, IRRELEVANT, REFUSED)

#: section -> (module, class) of the dataclass whose fields it records
SECTIONS: dict[str, tuple[str, str]] = {
    "actor": ("verl.workers.config", "FSDPActorConfig"),
    "engine": ("verl.workers.config", "FSDPEngineConfig"),
    "optim": ("verl.workers.config", "FSDPOptimizerConfig"),
    "model": ("verl.workers.config", "HFModelConfig"),
}


@dataclass(frozen=True)
class Field:
    """How one config field is treated: ``kind`` (one of the four), ``why`` (the knob's rule, the reason it is
    irrelevant, or why other values are refused) and, for a refused field, the values admitted."""

    kind: str
    why: str = ""
    admitted: Callable[[Any], bool] | None = None
    keys: tuple[str, ...] = ()  # a table-valued knob: the entries registered as knobs (verl.<section>.<name>.<key>)
    valid: Callable[[Any], bool] | None = None  # a knob: the values it takes (described by ``takes``)
    takes: str = ""

    @property
    def recorded(self) -> bool:
        return self.kind != IRRELEVANT


def _contract() -> Field:
    return Field(CONTRACT)


def _irrelevant(why: str) -> Field:
    return Field(IRRELEVANT, why)


def _refused(why: str, admitted: Callable[[Any], bool]) -> Field:
    return Field(REFUSED, why, admitted)


def _knob(why: str, valid: Callable[[Any], bool], takes: str, keys: tuple[str, ...] = ()) -> Field:
    return Field(KNOB, why, keys=keys, valid=valid, takes=takes)


def _flag(v: Any) -> bool:
    return isinstance(v, bool)


def _size(v: Any) -> bool:
    """Null (verl's unset) or a positive integer within 64 bits (not a bool, not a float)."""
    return v is None or (type(v) is int and 1 <= v < 2**63)


# the dtype names verl's PrecisionType reads (replayjob.runtime.knobs.VERL_PRECISIONS, without importing it here)
PRECISION_NAMES = ("16", "fp16", "float16", "torch.float16", "32", "fp32", "float32", "torch.float32", "bf16",
                   "bfloat16", "torch.bfloat16")
PRECISION_ENTRIES = ("param_dtype", "reduce_dtype", "buffer_dtype")
_FP16 = ("16", "fp16", "float16", "torch.float16")


def _precision_table(v: Any) -> bool:
    """Every entry recorded (as verl resolves an unset one), each a dtype name verl reads (fp16 parameters are refused
    by :func:`value_reason`: verl's gradient scaler, whose state no capture holds)."""
    return (isinstance(v, dict) and sorted(v) == sorted(PRECISION_ENTRIES)
            and all(isinstance(x, str) and x in PRECISION_NAMES for x in v.values()))


def _off(v: Any) -> bool:
    return v in (False, None, 0, "", {}, [])


def _not_enabled(v: Any) -> bool:
    return isinstance(v, dict) and _off(v.get("enable", False))


def _mode_disabled(v: Any) -> bool:
    return isinstance(v, dict) and v.get("mode") == "disabled"


_TARGET = _irrelevant("hydra's instantiation target (the dataclass itself), not a setting")
_ENGINE_HERE = "the engine reads its own copy (verl.engine.{0}), which the capture records"
_SEQUENCE_PARALLEL = _refused("Ulysses sequence parallelism splits each sequence over ranks; a replay runs whole "
                              "sequences on each rank", lambda v: v == 1)
_QAT = _refused("quantisation-aware training rewrites the model's linear layers; not replayed", _not_enabled)
_INFERENCE = _irrelevant("log-prob inference only (compute_log_prob / compute_ref_log_prob), not the update")
_PATH = _irrelevant("a path; the base model directory the replay config names is pinned by the SHA-256 of its "
                    "config.json and safetensors files")
_DERIVED = _irrelevant("an object verl derives from the files at model.path, which are pinned by SHA-256")

FIELDS: dict[str, dict[str, Field]] = {
    "actor": {
        "_target_": _TARGET,
        "strategy": _contract(),
        "ppo_mini_batch_size": _irrelevant("the captured step holds its mini-batch's rows; the size reaches the "
                                           "loss as the captured global_batch_size"),
        "ppo_micro_batch_size": _irrelevant("deprecated; the engine reads micro_batch_size_per_gpu "
                                            "(verl.engine.micro_batch_size_per_gpu)"),
        "ppo_micro_batch_size_per_gpu": _irrelevant(_ENGINE_HERE.format("micro_batch_size_per_gpu")),
        "ppo_infer_micro_batch_size_per_gpu": _INFERENCE,
        "use_dynamic_bsz": _irrelevant(_ENGINE_HERE.format("use_dynamic_bsz")),
        "ppo_max_token_len_per_gpu": _irrelevant(_ENGINE_HERE.format("max_token_len_per_gpu")),
        "ppo_infer_max_token_len_per_gpu": _INFERENCE,
        "clip_ratio": _contract(),
        "clip_ratio_low": _contract(),
        "clip_ratio_high": _contract(),
        "freeze_vision_tower": _contract(),
        "policy_loss": _contract(),
        "clip_ratio_c": _contract(),
        "loss_agg_mode": _contract(),
        "loss_scale_factor": _contract(),
        "entropy_coeff": _contract(),
        "tau_pos": _contract(),
        "tau_neg": _contract(),
        "calculate_entropy": _contract(),
        "calculate_sum_pi_squared": _contract(),
        "use_kl_loss": _contract(),
        "use_prefix_grouper": _refused("the prefix-grouped forward is not replayed", _off),
        "use_torch_compile": _contract(),
        "kl_loss_coef": _contract(),
        "kl_loss_type": _contract(),
        "ppo_epochs": _irrelevant("the captured step is one mini-batch of one epoch; which one is recorded in the "
                                  "manifest's framework_state"),
        "shuffle": _irrelevant("decides which rows form each mini-batch; the capture holds the step's rows"),
        "data_loader_seed": _irrelevant("seeds the mini-batch shuffle; the capture holds the step's rows"),
        "checkpoint": _irrelevant("where and what checkpoints are saved"),
        "optim": _irrelevant("recorded field by field as verl.optim (the engine's optimizer config)"),
        "use_fused_kernels": _irrelevant(_ENGINE_HERE.format("use_fused_kernels")),
        "profiler": _irrelevant("profiling only"),
        "engine": _irrelevant("recorded field by field as verl.engine"),
        "rollout_n": _irrelevant("samples per prompt at rollout; the captured rows and global_batch_size carry it"),
        "model_config": _irrelevant("recorded field by field as verl.model"),
        "global_batch_info": _irrelevant("scratch the loss fills from each batch (dp_size, batch_num_tokens, "
                                         "global_batch_size), all captured with the batch"),
        "qat": _QAT,
        "grad_clip": _irrelevant("deprecated alias; the engine clips with verl.optim.clip_grad"),
        "ulysses_sequence_parallel_size": _SEQUENCE_PARALLEL,
        "entropy_from_logits_with_chunking": _irrelevant(_ENGINE_HERE.format("entropy_from_logits_with_chunking")),
        "entropy_from_logits_chunk_size": _irrelevant(_ENGINE_HERE.format("entropy_from_logits_chunk_size")),
        "entropy_checkpointing": _irrelevant(_ENGINE_HERE.format("entropy_checkpointing")),
        "pad_to_length": _irrelevant(_ENGINE_HERE.format("pad_to_length")),
        "fsdp_config": _irrelevant("recorded field by field as verl.engine"),
        "use_remove_padding": _irrelevant(_ENGINE_HERE.format("use_remove_padding")),
        "use_rollout_log_probs": _irrelevant("decides on the driver which logprobs become old_log_probs; the "
                                             "capture holds old_log_probs as the update read them"),
    },
    "engine": {
        "_target_": _TARGET,
        "param_offload": _contract(),
        "optimizer_offload": _contract(),
        "forward_only": _refused("an engine built forward-only performs no update", _off),
        "strategy": _contract(),
        "dtype": _contract(),
        "use_dynamic_bsz": _knob("micro-batches by a token budget instead of a row count: the same rows and "
                                 "loss normalisation, another grouping and summation order "
                                 "(replayjob.runtime.knobs.VERL_DYNAMIC_BSZ)", _flag, "true or false"),
        "max_token_len_per_gpu": _knob("the token budget of a micro-batch under use_dynamic_bsz "
                                       "(replayjob.runtime.knobs.VERL_MAX_TOKENS)", _size,
                                       "a positive integer or null"),
        "micro_batch_size_per_gpu": _knob("the engine's micro-batch size: the same rows and loss normalisation, "
                                          "another summation order (replayjob.runtime.knobs.VERL_MICRO_BATCH)", _size,
                                          "a positive integer or null"),
        "infer_max_token_len_per_gpu": _INFERENCE,
        "infer_micro_batch_size_per_gpu": _INFERENCE,
        "use_fused_kernels": _refused("verl's fused kernels (Triton) are not replayed; capture with "
                                      "use_fused_kernels=False", _off),
        "use_remove_padding": _knob("packed rows instead of padded ones: the same per-row attention and "
                                    "loss, other kernel shapes and summation order; declared with "
                                    "verl.model.use_remove_padding (replayjob.runtime.knobs.VERL_REMOVE_PADDING)",
                                    _flag, "true or false"),
        "seed": _irrelevant("seeds the engine when it is built; the capture restores the Torch RNG state right "
                            "before the step"),
        "full_determinism": _contract(),
        "router_replay": _refused("mixture-of-experts router replay is not replayed", _mode_disabled),
        "wrap_policy": _contract(),
        "offload_policy": _contract(),
        "reshard_after_forward": _contract(),
        "fsdp_size": _contract(),
        "forward_prefetch": _contract(),
        "model_dtype": _contract(),
        "use_orig_params": _contract(),
        "mixed_precision": _knob("the dtypes FSDP2 computes (param_dtype, also autocast's) and reduces gradients "
                                 "(reduce_dtype) in: the same math, rounded at another precision, so the bits "
                                 "change (approximate claim; exact-input checks only the inputs); recorded as "
                                 "verl resolves it (unset: bf16, fp32, fp32); buffer_dtype, unused by FSDP2, is "
                                 "no knob (replayjob.runtime.knobs.VERL_PARAM_DTYPE, VERL_REDUCE_DTYPE)",
                                 _precision_table, "a table of param_dtype, reduce_dtype and buffer_dtype, each a "
                                 "dtype name verl reads (bf16, fp32, ...)", keys=("param_dtype", "reduce_dtype")),
        "ulysses_sequence_parallel_size": _SEQUENCE_PARALLEL,
        "entropy_from_logits_with_chunking": _contract(),
        "entropy_from_logits_chunk_size": _contract(),
        "use_torch_compile": _contract(),
        "entropy_checkpointing": _contract(),
        "use_no_sync_for_gradient_accumulation": _contract(),
        "pad_to_length": _contract(),
        "pad_to_length_bucket": _contract(),
        "qat": _QAT,
        "turbo_config": _refused("the fsdp_turbo engine is not replayed", _off),
    },
    "optim": {
        "_target_": _TARGET,
        "lr": _contract(),
        "lr_warmup_steps_ratio": _contract(),
        "total_training_steps": _contract(),
        "weight_decay": _contract(),
        "lr_warmup_steps": _contract(),
        "betas": _contract(),
        "clip_grad": _contract(),
        "grad_clip": _contract(),
        "optimizer": _contract(),
        "optimizer_impl": _contract(),
        "min_lr_ratio": _contract(),
        "warmup_style": _contract(),
        "lr_scheduler_type": _contract(),
        "num_cycles": _contract(),
        "override_optimizer_config": _contract(),
        "zero_indexed_step": _contract(),
    },
    "model": {
        "_target_": _TARGET,
        "path": _PATH,
        "local_path": _PATH,
        "hf_config_path": _PATH,
        "local_hf_config_path": _PATH,
        "tokenizer_path": _irrelevant("the tokenizer is not used by the update (token ids are captured)"),
        "local_tokenizer_path": _irrelevant("the tokenizer is not used by the update (token ids are captured)"),
        "model_type": _refused("only the actor's language model is replayed (a value model is not)",
                               lambda v: v == "language_model"),
        "load_tokenizer": _irrelevant("the tokenizer is not used by the update (token ids are captured)"),
        "hf_config": _DERIVED,
        "generation_config": _DERIVED,
        "tokenizer": _irrelevant("the tokenizer is not used by the update (token ids are captured)"),
        "processor": _irrelevant("multi-modal processors are not used by a text update"),
        "use_shm": _irrelevant("copies the model files to shared memory before loading; same files"),
        "trust_remote_code": _refused("remote model code is not pinned by the capture", _off),
        "custom_chat_template": _irrelevant("chat formatting happens before the token ids the capture holds"),
        "external_lib": _irrelevant("a module imported for its side effects (the capture switch itself is one); "
                                    "a model class it registers would be refused by the base model's "
                                    "architectures, which the pinned config.json names"),
        "override_config": _contract(),
        "enable_gradient_checkpointing": _knob("recomputes each layer's forward in backward with the RNG state "
                                               "restored (replayjob.runtime.knobs.VERL_GRADIENT_CHECKPOINTING)", _flag,
                                               "true or false"),
        "enable_activation_offload": _contract(),
        "use_remove_padding": _knob("the model-side switch of verl.engine.use_remove_padding, declared with "
                                    "it (replayjob.runtime.knobs.VERL_REMOVE_PADDING_MODEL)", _flag, "true or false"),
        "lora_rank": _contract(),
        "lora_alpha": _contract(),
        "target_modules": _contract(),
        "target_parameters": _contract(),
        "exclude_modules": _contract(),
        "lora": _contract(),
        "lora_adapter_path": _refused("an adapter loaded from a path at build is not pinned; start LoRA from "
                                      "lora_rank (the capture pins the adapter as it is at the step)", _off),
        "use_liger": _refused("Liger kernels are not replayed", _off),
        "use_fused_kernels": _refused("verl's fused kernels (Triton) are not replayed", _off),
        "fused_kernel_options": _contract(),
        "tiled_mlp": _contract(),
        "architectures": _contract(),
        "mtp": _refused("multi-token prediction layers are not replayed", _not_enabled),
    },
}


def classify(section: str, name: str) -> Field | None:
    """The classification of ``verl.<section>.<name>``, or None when it is not classified."""
    return FIELDS.get(section, {}).get(name)


def value_reason(section: str, name: str, value: Any) -> str | None:
    """Why ``verl.<section>.<name> = value`` cannot be recorded or replayed (``None``: it can): a refused field at a
    value it does not admit, a knob at a value it does not take."""
    f = classify(section, name)
    if f is None:
        return (f"verl.{section}.{name} is not classified for this verl version (contract, systems knob, irrelevant "
                "or refused)")
    if f.kind == REFUSED and f.admitted is not None and not f.admitted(value):
        return f"verl.{section}.{name} = {_shown(value)} is not replayed: {f.why}"
    if f.kind == KNOB and f.valid is not None and not f.valid(value):
        return f"verl.{section}.{name} is {_shown(value)}; it takes {f.takes}"
    if (section, name) == ("engine", "mixed_precision") and value["param_dtype"] in _FP16:
        return ("verl.engine.mixed_precision.param_dtype = fp16 is not replayed: verl's gradient scaler (its scale "
                "and growth state) is not captured")
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def config_reasons(values: Any) -> list[str]:
    """Why a recorded (or resolved) ``verl`` config section is not one a capture writes (empty: it is): the loss and
    the four sections, each a table of exactly its recorded fields (no irrelevant or unknown field, none missing),
    each at a value its class admits (:func:`value_reason`)."""
    if not isinstance(values, dict):
        return [f"verl is {_shown(values)}, not a table of the loss and the sections {', '.join(FIELDS)}"]
    why = [f"verl.{key} is no section a capture records (it records loss, {', '.join(FIELDS)})"
           for key in sorted(set(values) - {"loss", *FIELDS})]
    for section, fields in FIELDS.items():
        sec = values.get(section)
        if not isinstance(sec, dict):
            why.append(f"verl.{section} is {_shown(sec)}, not a table of verl's {SECTIONS[section][1]} fields")
            continue
        for name in sorted(set(sec) - {n for n, f in fields.items() if f.recorded}):
            f = fields.get(name)
            why.append(f"verl.{section}.{name} is no field of verl's {SECTIONS[section][1]}" if f is None else
                       f"verl.{section}.{name} is irrelevant to the update and never recorded ({f.why}); a replay "
                       "cannot set it")
        for name, f in fields.items():
            if not f.recorded:
                continue
            if name not in sec:
                why.append(f"verl.{section}.{name} is missing: a capture records every {f.kind} field")
                continue
            reason = value_reason(section, name, sec[name])
            if reason is not None:
                why.append(reason)
    return why


def knob_keys() -> list[str]:
    """The dotted keys classified as systems knobs (each registered in :mod:`replayjob.runtime.knobs`)."""
    return [key for s, fields in FIELDS.items() for n, f in fields.items() if f.kind == KNOB
            for key in ([f"verl.{s}.{n}.{k}" for k in f.keys] or [f"verl.{s}.{n}"])]


DOC_BEGIN, DOC_END = "<!-- verl-fields: begin -->\n", "<!-- verl-fields: end -->"


def table() -> str:
    """The classification as the Markdown table docs/verl.md carries between :data:`DOC_BEGIN` and :data:`DOC_END`
    (``python -m replayjob.producers.verl.fields`` prints it; a test checks the page against it)."""
    rows = ["| Field | Class | Why / rule |", "|---|---|---|"]
    for section, fields in FIELDS.items():
        for name, f in fields.items():
            why = f.why.replace("|", "\\|") if f.kind != CONTRACT else "defines the update's math"
            rows.append(f"| `verl.{section}.{name}` | {f.kind} | {why} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
