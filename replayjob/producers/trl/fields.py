"""Every field of TRL's ``GRPOConfig`` and ``RLOOConfig``, classified once (docs/trl-fields.md is generated from it).

Each field is one of:

- ``contract``: part of the update: the value the update's arithmetic reads (the policy loss, its normaliser, the
  optimizer and schedule, precision, the forward), or the one that says what the captured inputs mean.  It enters
  the optimizer contract (:func:`replayjob.producers.trl.producer.contract`) and the replay's trainer is built with it;
  a difference between capture and replay is refused.  A few enter only when another field switches them on
  (``when``: the vLLM correction's settings only with ``use_vllm``).
- ``knob``: a registered systems-only knob of TRL (:func:`replayjob.runtime.knobs.knobs_for` ``("trl")``): declared, it
  may differ; its value in effect is observed at run time and compared with the value the registry's ``predict`` rule
  expects (``rule``: how the replay derives it).  The geometry knobs are in the contract too (the source's values
  stand in when they are declared).
- ``irrelevant``: read only outside the one captured update (``reason``: generation, rewards and advantages, which
  are captured inputs, logging, evaluation, checkpoints, the hub, the dataset).  The replay's trainer is built
  with TRL's default for it, so a replay never depends on it (a capture made with two reward functions and
  ``reward_weights`` replays with none); a difference between capture and replay is still refused, so a replay
  config states the run it stands for.
- ``refused``: TRL applies it where a replay cannot (in ``Trainer.train()``, which a replay does not run, or by a
  sharded engine): a capture that sets it is refused by ``explain`` and ``replay`` (``allowed``: the values that
  mean "off").

A field the installed TRL has and this table lacks fails a test (tests/test_trl_fields.py), so a new TRL release
cannot add a field that changes the update unnoticed.  This module imports nothing from TRL.

Example:
    >>> FIELDS["router_aux_loss_coef"].kind
    'contract'
    >>> FIELDS["reward_weights"].kind, FIELDS["reward_weights"].reason.split(":")[0]
    ('irrelevant', 'rewards')
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from replayjob.redact import REDACTED

CONTRACT, KNOB, IRRELEVANT, REFUSED = "contract", "knob", "irrelevant", "refused"
KINDS = (CONTRACT, KNOB, IRRELEVANT, REFUSED)
CONFIGS = ("GRPOConfig", "RLOOConfig")


@dataclass(frozen=True)
class Field:
    """One config field's class and why (see the module docstring)."""

    name: str
    kind: str
    reason: str
    rule: str = ""  # a knob: the rule that gives its value in effect
    when: str = ""  # a contract field that enters the contract only when this field is true
    allowed: tuple[Any, ...] = ()  # a refused field: the values that switch it off


def _group(kind: str, reason: str, names: str, **extra: Any) -> dict[str, Field]:
    return {n: Field(n, kind, reason, **extra) for n in names.split()}


_SAME = "the replay's value (unchanged unless distributed.num_processes or trl.per_device_train_batch_size is declared)"
_DERIVED = ("knobs.trl_geometry: the captured rows re-split into micro-batches of per_device_train_batch_size give "
            "rows / size accumulation steps, steps_per_generation scaled with them; otherwise " + _SAME)

FIELDS: dict[str, Field] = {
    # -- contract ------------------------------------------------------------------------------------------
    **_group(CONTRACT, "policy loss: the objective, its clipping, KL and masking terms",
             "loss_type beta epsilon epsilon_high delta importance_sampling_level use_bias_correction_kl "
             "mask_truncated_completions top_entropy_quantile off_policy_mask_threshold sapo_temperature_pos "
             "sapo_temperature_neg vespo_k_pos vespo_k_neg vespo_lambda_pos vespo_lambda_neg"),
    **_group(CONTRACT, "entropy bonus: its coefficient and the adaptive controller's settings enter the loss",
             "entropy_coef use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target"),
    **_group(CONTRACT, "MoE load-balancing loss: the router's auxiliary loss is added to the policy loss with this "
             "coefficient (None: the architecture's own)", "router_aux_loss_coef"),
    **_group(CONTRACT, "loss normaliser: dr_grpo divides by max_completion_length, dapo by the tokens counted "
             "across devices", "max_completion_length average_tokens_across_devices"),
    **_group(CONTRACT, "forward: TRL's fused LM head divides the logits by the temperature before the logprobs; "
             "an fp32 LM head and switched-off dropout change the forward", "temperature cast_lm_head_to_fp32 "
             "disable_dropout"),
    **_group(CONTRACT, "what the captured inputs mean: how many completions form a group, how often the same "
             "generation is reused, how the advantages were scaled", "num_generations num_iterations "
             "scale_rewards"),
    **_group(CONTRACT, "optimizer and schedule: the update's step and its learning rate",
             "optim optim_args optim_target_modules learning_rate weight_decay adam_beta1 adam_beta2 adam_epsilon "
             "lr_scheduler_type lr_scheduler_kwargs warmup_steps max_steps max_grad_norm"),
    **_group(CONTRACT, "precision: the autocast and matmul precision the update computes in", "bf16 fp16 tf32"),
    **_group(CONTRACT, "device and determinism the update ran under (not registered knobs): held at the captured "
             "value", "use_cpu full_determinism accelerator_config ddp_backend ddp_bucket_cap_mb "
             "ddp_broadcast_buffers ddp_find_unused_parameters ddp_static_graph"),
    **_group(CONTRACT, "vLLM's importance-sampling correction multiplies each token's loss by the captured "
             "sampler ratio, clipped or masked by these settings", "use_vllm vllm_importance_sampling_correction "
             "vllm_importance_sampling_mode vllm_importance_sampling_clip_min vllm_importance_sampling_clip_max "
             "vllm_importance_sampling_cap", when="use_vllm"),
    # -- registered systems-only knobs ---------------------------------------------------------------------
    **_group(KNOB, "batch geometry: the micro-batch size a replay re-splits the captured rows into",
             "per_device_train_batch_size", rule="min(size, the largest process's rows)"),
    **_group(KNOB, "batch geometry: derived from the micro-batch size or declared with a process-count change",
             "gradient_accumulation_steps steps_per_generation", rule=_DERIVED),
    **_group(KNOB, "activation checkpointing recomputes the same forward (trl.gradient_checkpointing)",
             "gradient_checkpointing activation_checkpointing", rule="as declared (activation_checkpointing is "
             "the same setting under transformers' new name)"),
    **_group(KNOB, "the checkpoint function's variant (trl.gradient_checkpointing_kwargs.use_reentrant)",
             "gradient_checkpointing_kwargs activation_checkpointing_kwargs",
             rule="use_reentrant as declared, transformers' default (False) when unset, none without checkpointing"),
    # -- irrelevant to the one captured update -------------------------------------------------------------
    **_group(IRRELEVANT, "generation: the completions and their sampler logprobs are captured inputs",
             "top_p top_k min_p repetition_penalty generation_kwargs chat_template_kwargs cache_implementation "
             "generation_batch_size pad_to_multiple_of max_tool_calling_iterations ds3_gather_for_generation "
             "use_transformers_paged use_transformers_continuous_batching transformers_continuous_batching_config "
             "vllm_mode vllm_model_impl vllm_enable_sleep_mode vllm_structured_outputs_regex vllm_server_base_url "
             "vllm_server_host vllm_server_port vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization "
             "vllm_max_model_length vllm_tensor_parallel_size num_generations_eval"),
    **_group(IRRELEVANT, "rewards: the update reads the captured advantages, not the rewards they came from",
             "reward_weights multi_objective_aggregation normalize_advantages reward_clip_range"),
    **_group(IRRELEVANT, "reference model: its logprobs are captured inputs; syncing it happens between steps",
             "sync_ref_model ref_model_mixup_alpha ref_model_sync_steps"),
    **_group(IRRELEVANT, "model loading: the replay loads the base model from its hashed directory with the "
             "captured dtype and attention implementation", "model_init_kwargs trust_remote_code use_cache"),
    **_group(IRRELEVANT, "randomness: the Torch RNG state before each loss call is captured and restored",
             "seed data_seed"),
    **_group(IRRELEVANT, "dataset and sampling order: the captured rows are what the step consumed",
             "shuffle_dataset remove_unused_columns label_names train_sampling_strategy length_column_name "
             "dataloader_drop_last dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers "
             "dataloader_prefetch_factor dataloader_multiprocessing_context dataloader_in_order "
             "num_train_epochs ignore_data_skip"),
    **_group(IRRELEVANT, "logging: what is reported, never what is computed",
             "logging_strategy logging_steps logging_first_step log_on_each_node logging_nan_inf_filter "
             "include_num_input_tokens_seen log_level log_level_replica disable_tqdm report_to run_name project "
             "trackio_space_id trackio_bucket_id trackio_static_space_id log_completions log_multimodal "
             "num_completions_to_print log_unique_prompts skip_memory_metrics debug"),
    **_group(IRRELEVANT, "evaluation: runs outside the training step", "eval_strategy eval_steps eval_delay "
             "per_device_eval_batch_size prediction_loss_only eval_on_start eval_do_concat_batches "
             "eval_use_gather_object eval_accumulation_steps include_for_metrics batch_eval_metrics bf16_full_eval "
             "fp16_full_eval load_best_model_at_end metric_for_best_model greater_is_better do_train do_eval "
             "do_predict"),
    **_group(IRRELEVANT, "checkpoints and outputs: where and when state is saved", "output_dir save_only_model "
             "save_strategy save_steps save_on_each_node save_total_limit enable_jit_checkpoint "
             "resume_from_checkpoint restore_callback_states_from_checkpoint torch_empty_cache_steps"),
    **_group(IRRELEVANT, "hub: uploads, never the update", "push_to_hub hub_token hub_private_repo hub_model_id "
             "hub_strategy hub_always_push hub_revision log_completions_hub_repo"),
    **_group(IRRELEVANT, "launch: the process's rank comes from the launcher (the process count is "
             "distributed.num_processes)", "local_rank ddp_timeout"),
    **_group(IRRELEVANT, "read by GRPOTrainer only for the loss of the transformers Trainer, which TRL replaces",
             "label_smoothing_factor"),
    **_group(IRRELEVANT, "read only with torch_compile or use_liger_kernel, both refused when set",
             "torch_compile_backend torch_compile_mode liger_kernel_config"),
    # -- refused -------------------------------------------------------------------------------------------
    **_group(REFUSED, "applied by Trainer.train(), which a replay does not run (it stands the trainer at the "
             "captured step): the replay would compute without it", "use_liger_kernel neftune_noise_alpha "
             "torch_compile auto_find_batch_size", allowed=(None, False)),
    **_group(REFUSED, "a sharded engine (DeepSpeed, FSDP, tensor or context parallelism): the adapter and "
             "optimizer state are not whole in each process; replayjob captures DDP runs",
             "deepspeed fsdp fsdp_config parallelism_config", allowed=(None, False, "", [], {})),
}



# -- what a recorded value may be ----------------------------------------------------------------------------
# Every contract and knob field's value as a capture records it (GRPOConfig's value after its own resolution, as JSON),
# declared once: the admission reads a recorded (or overridden) config through it (:func:`config_reasons`), so a
# re-pinned manifest whose TRL config no trainer resolves to is refused naming the field and the rule, before a
# trainer is built.

@dataclass(frozen=True)
class Domain:
    """The values one recorded field takes: ``takes`` says which, ``holds`` decides."""

    takes: str
    holds: Any  # Callable[[Any], bool]


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _num(takes: str, ok: Any = lambda v: True, none: bool = False) -> Domain:
    return Domain(takes + (" or null" if none else ""), lambda v: (none and v is None) or (_is_num(v) and ok(v)))


def _int(low: int, none: bool = False) -> Domain:
    return Domain(f"an integer >= {low}" + (" or null" if none else ""),
                  lambda v: (none and v is None) or (type(v) is int and low <= v < 2**63))


def _bool(none: bool = False) -> Domain:
    return Domain("true or false" + (" or null" if none else ""), lambda v: type(v) is bool or (none and v is None))


def _choice(*values: str) -> Domain:
    return Domain("one of " + ", ".join(repr(v) for v in values), lambda v: isinstance(v, str) and v in values)


def _text(none: bool = False) -> Domain:
    return Domain("a non-empty string" + (" or null" if none else ""),
                  lambda v: (none and v is None) or (isinstance(v, str) and v != ""))


def _table_or_none(v: Any) -> bool:
    return v is None or isinstance(v, dict)


# the keys transformers passes from ``gradient_checkpointing_kwargs`` to the checkpoint function (and the two it
# takes for itself), each of the type it takes
_CHECKPOINT_KWARGS: dict[str, Any] = {
    "use_reentrant": lambda v: v is None or type(v) is bool, "preserve_rng_state": lambda v: type(v) is bool,
    "determinism_check": lambda v: v in ("default", "none"), "debug": lambda v: type(v) is bool,
    "every_n_layers": lambda v: type(v) is int and 1 <= v < 2**63, "offload": lambda v: type(v) is bool}


def _checkpoint_kwargs(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and all(k in _CHECKPOINT_KWARGS and _CHECKPOINT_KWARGS[k](x)
                                                     for k, x in v.items()))


_NONNEG, _POS = (lambda v: v >= 0), (lambda v: v > 0)
# transformers' SchedulerType values (a test compares them with the installed transformers')
SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
              "warmup_stable_decay", "greedy")
# the param-group setting torch's optimizer of each of these ``optim`` names holds (a captured optimizer state of
# another optimizer contradicts the recorded ``optim``)
OPTIM_GROUP_KEYS = {"adamw_torch": "betas", "adamw_torch_fused": "betas", "sgd": "momentum", "adagrad": "lr_decay",
                    "rmsprop": "alpha"}
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")

DOMAINS: dict[str, Domain] = {
    "loss_type": _choice(*LOSS_TYPES),
    "beta": _num("a finite number >= 0", _NONNEG), "epsilon": _num("a finite number >= 0", _NONNEG),
    "epsilon_high": _num("a finite number >= 0", _NONNEG, none=True),
    "delta": _num("a finite number > 0", _POS, none=True),
    "importance_sampling_level": _choice("token", "sequence"),
    "use_bias_correction_kl": _bool(), "mask_truncated_completions": _bool(),
    "top_entropy_quantile": _num("a finite number in [0, 1]", lambda v: 0 <= v <= 1),
    "off_policy_mask_threshold": _num("a finite number >= 0", _NONNEG, none=True),
    **{n: _num("a finite number > 0", _POS) for n in (
        "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_k_neg", "vespo_lambda_pos",
        "vespo_lambda_neg")},
    "entropy_coef": _num("a finite number"), "use_adaptive_entropy": _bool(),
    "entropy_coef_min": _num("a finite number"), "entropy_coef_max": _num("a finite number"),
    "entropy_coef_delta": _num("a finite number >= 0", _NONNEG), "entropy_target": _num("a finite number"),
    "router_aux_loss_coef": _num("a finite number", none=True),
    "max_completion_length": _int(1), "average_tokens_across_devices": _bool(),
    "temperature": _num("a finite number > 0", _POS), "cast_lm_head_to_fp32": _bool(), "disable_dropout": _bool(),
    "num_generations": _int(2), "num_iterations": _int(1), "scale_rewards": _choice("group", "batch", "none"),
    "optim": _text(), "optim_args": _text(none=True),
    "optim_target_modules": Domain("null, a string or a list of strings", lambda v: v is None or isinstance(v, str)
                                   or (isinstance(v, list) and all(isinstance(x, str) for x in v))),
    "learning_rate": _num("a finite number >= 0", _NONNEG), "weight_decay": _num("a finite number >= 0", _NONNEG),
    "adam_beta1": _num("a finite number in [0, 1)", lambda v: 0 <= v < 1),
    "adam_beta2": _num("a finite number in [0, 1)", lambda v: 0 <= v < 1),
    "adam_epsilon": _num("a finite number >= 0", _NONNEG), "lr_scheduler_type": _choice(*SCHEDULERS),
    "lr_scheduler_kwargs": Domain("a table or null", _table_or_none),
    "warmup_steps": _num("a finite number >= 0", _NONNEG),
    "max_steps": Domain("an integer >= 1, or -1 (the epochs decide)",
                        lambda v: type(v) is int and (v == -1 or 1 <= v < 2**63)),
    "max_grad_norm": _num("a finite number >= 0", _NONNEG),
    "bf16": _bool(none=True), "fp16": _bool(), "tf32": _bool(none=True), "use_cpu": _bool(),
    "full_determinism": _bool(), "accelerator_config": Domain("a table or null", _table_or_none),
    "ddp_backend": _text(none=True), "ddp_bucket_cap_mb": _int(1, none=True),
    "ddp_broadcast_buffers": _bool(none=True), "ddp_find_unused_parameters": _bool(none=True),
    "ddp_static_graph": _bool(none=True),
    "use_vllm": _bool(), "vllm_importance_sampling_correction": _bool(),
    "vllm_importance_sampling_mode": _choice("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    "vllm_importance_sampling_clip_min": _num("a finite number >= 0", _NONNEG, none=True),
    "vllm_importance_sampling_clip_max": _num("a finite number > 0", _POS, none=True),
    "vllm_importance_sampling_cap": _num("a finite number > 0", _POS, none=True),
    "per_device_train_batch_size": _int(1), "gradient_accumulation_steps": _int(1), "steps_per_generation": _int(1),
    "gradient_checkpointing": _bool(), "activation_checkpointing": _bool(none=True),
    **{n: Domain("null or a table of the checkpoint function's settings (" + ", ".join(_CHECKPOINT_KWARGS)
                 + ", each of its type)", _checkpoint_kwargs)
       for n in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")},
}

# The contract and knob fields RLOOConfig lacks (GRPOTrainer's loss alone reads them): a GRPO capture records each, an
# RLOO capture none (a test compares this with the installed TRL's two configs).
_GRPO_ONLY = (
    "loss_type delta importance_sampling_level use_bias_correction_kl top_entropy_quantile off_policy_mask_threshold "
    "sapo_temperature_pos sapo_temperature_neg vespo_k_pos vespo_k_neg vespo_lambda_pos vespo_lambda_neg "
    "entropy_coef use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target "
    "cast_lm_head_to_fp32 scale_rewards vllm_importance_sampling_correction vllm_importance_sampling_mode "
    "vllm_importance_sampling_clip_min vllm_importance_sampling_clip_max vllm_importance_sampling_cap")
GRPO_ONLY = frozenset(_GRPO_ONLY.split())


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def config_reasons(values: Any, trainer: str = "GRPOTrainer") -> list[str]:
    """Why a recorded (or overridden) ``trl`` config is not one ``trainer``'s config resolves to (empty: it is): a
    table of fields this table classifies, holding every contract and knob field the trainer's config has (none of
    GRPO's own in an RLOO capture), each at a value of its :data:`DOMAINS` entry, and a refused field only at a value
    that switches it off."""
    if not isinstance(values, dict):
        return [f"trl is {_shown(values)}, not a table of the trainer config's fields"]
    why = [f"trl.{n} is no field of TRL's {' or '.join(CONFIGS)} this replayjob classifies (a capture records the "
           "installed TRL's fields; replay with the TRL version the capture recorded)"
           for n in sorted(set(values) - set(FIELDS))]
    for n, dom in DOMAINS.items():
        if n in GRPO_ONLY and trainer != "GRPOTrainer":
            if n in values:
                why.append(f"trl.{n} is no field of {trainer}'s config (GRPOTrainer's loss reads it)")
            continue
        if n not in values:
            why.append(f"trl.{n} is missing: a capture records every field of the update ({FIELDS[n].kind})")
        elif values[n] != REDACTED and not dom.holds(values[n]):
            why.append(f"trl.{n} is {_shown(values[n])}; it takes {dom.takes}")
    return why + refusals(values)


def _off(value: Any, allowed: tuple[Any, ...]) -> bool:
    return any(type(value) is type(a) and value == a for a in allowed)


def fields_of(kind: str) -> tuple[str, ...]:
    """The names of every field of one kind, in table order."""
    return tuple(n for n, f in FIELDS.items() if f.kind == kind)


def contract_fields(values: dict[str, Any]) -> tuple[str, ...]:
    """The fields that enter the contract for a captured config ``values``: every contract field (those with a
    ``when`` only when that field is true) and the geometry knobs."""
    keep = [n for n, f in FIELDS.items() if f.kind == CONTRACT and (not f.when or values.get(f.when))]
    return (*keep, "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation")


def replayed_fields() -> tuple[str, ...]:
    """The fields a replay's trainer is built with (the others take TRL's defaults): contract and knob fields."""
    return tuple(n for n, f in FIELDS.items() if f.kind in (CONTRACT, KNOB))


def refusals(values: dict[str, Any]) -> list[str]:
    """Why a captured config cannot be replayed: every refused field set to a value other than "off"."""
    return [f"trl.{n} = {values[n]!r} is not replayed: {f.reason}; capture a run without it"
            for n, f in FIELDS.items() if f.kind == REFUSED and n in values and not _off(values[n], f.allowed)]


def unclassified(names: list[str] | set[str]) -> list[str]:
    """The names in ``names`` this table does not classify (a test feeds it the installed TRL's fields)."""
    return sorted(set(names) - set(FIELDS))


def markdown() -> str:
    """docs/trl-fields.md, generated from the table (``python -m replayjob.producers.trl.fields``)."""
    heads = {CONTRACT: "Contract", KNOB: "Registered systems-only knobs", IRRELEVANT: "Irrelevant to the update",
             REFUSED: "Refused"}
    lines = ["# TRL config fields", "",
             "Every field of TRL's `GRPOConfig` and `RLOOConfig` as replayjob classifies it "
             "(`replayjob/producers/trl/fields.py`; this page is generated from it and checked by a test: "
             "`python -m replayjob.producers.trl.fields > docs/trl-fields.md`). A field the installed TRL "
             "has and the table lacks fails the test suite. What each class means:", "",
             "- **contract**: part of the update; in the optimizer contract, the replay's trainer is built with it, "
             "a difference between capture and replay is refused (a field with a condition enters only when that "
             "field is true);",
             "- **knob**: a registered systems-only knob (`trl.<field>`): declared in "
             "`optimizer_batch.allow_config_differences`, it may differ; `reduce` compares its value in effect with "
             "the value its rule gives (the replay applies the same rule);",
             "- **irrelevant**: read only outside the captured update; the replay's trainer takes TRL's default "
             "for it, so a replay never depends on it (a difference is still refused: a replay config states the "
             "run it stands for);",
             "- **refused**: `explain` and `replay` refuse a capture that sets it to anything but the values listed.",
             ""]
    for kind in KINDS:
        lines += [f"## {heads[kind]}", ""]
        extra = {CONTRACT: "When", KNOB: "Rule", REFUSED: "Allowed"}.get(kind)
        lines.append("| Field | Why |" + (f" {extra} |" if extra else ""))
        lines.append("|---|---|" + ("---|" if extra else ""))
        for n, f in FIELDS.items():
            if f.kind != kind:
                continue
            cell = {CONTRACT: f"`{f.when}`" if f.when else "", KNOB: f.rule,
                    REFUSED: ", ".join(f"`{a!r}`" for a in f.allowed)}.get(kind)
            lines.append(f"| `{n}` | {f.reason} |" + (f" {cell} |" if extra else ""))
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
