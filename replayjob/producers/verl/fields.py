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
integer or null, the precision table its three entries named as verl names a dtype.  A contract field declares its
type and range (``spec``, a :class:`Takes`, from the annotation of verl's dataclass and what verl's update does with
the value): a number is a JSON number (never a bool or a string), finite and within float32's range (the loss and
AdamW compute in float32 or narrower: a larger magnitude is infinite there) and within the field's own range
(``clip_ratio`` in [0, 1], ``clip_ratio_c`` above 1, ...); an integer a JSON integer; a name one verl acts on
(``loss_agg_mode``, ``kl_loss_type``, the policy loss, the LR scheduler; the optimizer's module only ``torch.optim``,
since verl imports it by name at build); a table of verl's nested dataclass (``policy_loss``, ``tiled_mlp``) exactly
its entries, each declared the same way.  :func:`value_reasons` is the one rule a capture records a field by and
:func:`config_reasons` the one rule a replay's admission reads the recorded ``verl`` section by (exactly the
recorded fields of each section, each a value its class admits, every reason listed): a re-pinned manifest whose
section names an irrelevant or unknown field (``model.external_lib``, a module verl imports), holds a refused value
(``model.trust_remote_code = true``), a knob of another type or a contract field of another type or range
(``actor.clip_ratio = "0.2"``, ``true`` or ``1e308``) is refused before any engine is built.

:data:`FIELDS` is a declaration a test walks: every field of the installed verl's dataclasses must be
listed here, so a verl release that adds a field fails that test (and a capture refuses a config with an
unclassified field) until someone classifies it.  This module imports nothing heavy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from replayjob.runtime.knobs import VERL_PRECISIONS

CONTRACT, KNOB, IRRELEVANT, REFUSED = "contract", "knob", "irrelevant", "refused"
KINDS = (CONTRACT, KNOB, IRRELEVANT, REFUSED)

#: section -> (module, class) of the dataclass whose fields it records
SECTIONS: dict[str, tuple[str, str]] = {
    "actor": ("verl.workers.config", "FSDPActorConfig"),
    "engine": ("verl.workers.config", "FSDPEngineConfig"),
    "optim": ("verl.workers.config", "FSDPOptimizerConfig"),
    "model": ("verl.workers.config", "HFModelConfig"),
}


FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32


@dataclass(frozen=True)
class Takes:
    """The values a contract field (or an entry of one) takes: ``ok`` decides a value, ``text`` says which (in a
    refusal and on the page); a table of a verl dataclass lists its ``entries``, exactly these keys, each declared
    the same way; ``null`` admits null besides."""

    text: str
    ok: Callable[[Any], bool]
    entries: dict[str, Takes] | None = None
    null: bool = False

    def reasons(self, where: str, value: Any) -> list[str]:
        """Why ``value`` at ``where`` (a dotted name) is not one of these values (empty: it is), every reason."""
        if value is None and self.null:
            return []
        if self.entries is None or not isinstance(value, dict):
            return [] if self.entries is None and self.ok(value) else [f"{where} is {_shown(value)}; it takes "
                                                                       f"{self.text}"]
        why = [f"{where}.{key} is no entry of {self.text}" for key in sorted(set(value) - set(self.entries))]
        for key, spec in self.entries.items():
            if key not in value:
                why.append(f"{where}.{key} is missing: a capture records every entry of {self.text}")
            else:
                why += spec.reasons(f"{where}.{key}", value[key])
        return why


def _or_null(spec: Takes) -> Takes:
    return Takes(spec.text + " or null", spec.ok, spec.entries, null=True)


def _is_number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and abs(v) <= FLOAT32_MAX


def _bound(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _number(lo: float | None = None, hi: float | None = None, *, above: bool = False, below: bool = False) -> Takes:
    """A finite JSON number (int or float, not a bool) within float32's range and ``lo`` <= (< with ``above``) it
    <= (< with ``below``) ``hi``."""
    def ok(v: Any) -> bool:
        return (_is_number(v) and (lo is None or (v > lo if above else v >= lo))
                and (hi is None or (v < hi if below else v <= hi)))

    if lo is not None and hi is not None:
        text = f"a number in {'(' if above else '['}{_bound(lo)}, {_bound(hi)}{')' if below else ']'}"
    elif lo is not None:
        text = f"a number {'>' if above else '>='} {_bound(lo)}"
    else:
        text = "a number"
    return Takes(text + " (finite, within float32's range)", ok)


def _integer(lo: int, *, also: tuple[int, ...] = ()) -> Takes:
    """A JSON integer (not a bool, not a float) within 64 bits, >= ``lo`` or one of ``also``."""
    def ok(v: Any) -> bool:
        return type(v) is int and (lo <= v < 2**63 or v in also)

    return Takes("".join(f"{a} or " for a in also) + f"an integer >= {lo}", ok)


FLAG = Takes("true or false", lambda v: isinstance(v, bool))
TEXT = Takes("a string", lambda v: isinstance(v, str))
NAMES = Takes("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))


def _choice(*names: str) -> Takes:
    return Takes("one of " + ", ".join(repr(n) for n in names), lambda v: isinstance(v, str) and v in names)


def _finite(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _finite(x) for k, x in v.items())
    if isinstance(v, list):
        return all(_finite(x) for x in v)
    return v is None or isinstance(v, bool | int | str)


#: a free-form table verl passes on (to transformers, FSDP, peft): an object of JSON values, every number finite
TABLE = Takes("a table (an object of JSON values, every number finite)", lambda v: isinstance(v, dict) and _finite(v))


def _entries(name: str, **entries: Takes) -> Takes:
    return Takes(f"verl's {name} ({', '.join(entries)})", lambda v: isinstance(v, dict), entries)


@dataclass(frozen=True)
class Field:
    """How one config field is treated: ``kind`` (one of the four), ``why`` (the knob's rule, the reason it is
    irrelevant, or why other values are refused), for a refused field the values admitted, and for a contract field
    its type and range (``spec``)."""

    kind: str
    why: str = ""
    admitted: Callable[[Any], bool] | None = None
    keys: tuple[str, ...] = ()  # a table-valued knob: the entries registered as knobs (verl.<section>.<name>.<key>)
    valid: Callable[[Any], bool] | None = None  # a knob: the values it takes (described by ``takes``)
    takes: str = ""
    spec: Takes | None = None  # a contract field: the values it takes

    @property
    def recorded(self) -> bool:
        return self.kind != IRRELEVANT


def _contract(spec: Takes) -> Field:
    return Field(CONTRACT, spec=spec)


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


# the dtype names verl's PrecisionType reads
PRECISION_NAMES = tuple(name for names in VERL_PRECISIONS.values() for name in names)
PRECISION_ENTRIES = ("param_dtype", "reduce_dtype", "buffer_dtype")
_FP16 = VERL_PRECISIONS["fp16"]


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

# the types and ranges of contract fields (each from verl's annotation and what its update does with the value)
_RATIO = _number(0, 1)
_COEF = _number(0)
_STRATEGY = _choice("fsdp", "fsdp2")  # the backends of verl's FSDP engine (EngineRegistry), which a replay builds
_DTYPE = _choice(*PRECISION_NAMES)
_LOSS_AGG = _choice("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                    "seq-mean-token-sum-norm")  # ActorConfig.__post_init__'s
_KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")  # core_algos.kl_penalty's ("full" raises)
_KL = _choice(*_KL_PENALTIES, *(k + "+" for k in _KL_PENALTIES))
_SCHEDULER = _choice("constant", "cosine")  # what the FSDP engine's _build_lr_scheduler builds (else it raises)
_POLICY_LOSSES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
                  "cispo", "bypass_mode")  # verl 0.9.1's registered policy losses (a replay imports no other)
_THRESHOLD = Takes("a number or a string", lambda v: _is_number(v) or isinstance(v, str))
_POLICY_LOSS = _entries(
    "PolicyLossConfig", _target_=TEXT, loss_mode=_choice(*_POLICY_LOSSES), clip_cov_ratio=_RATIO,
    clip_cov_lb=_number(), clip_cov_ub=_number(), kl_cov_ratio=_RATIO, ppo_kl_coef=_COEF, dro_beta=_or_null(_COEF),
    rollout_correction=_entries("RolloutCorrectionConfig", _target_=TEXT, rollout_is=_or_null(TEXT),
                                rollout_is_threshold=_THRESHOLD, rollout_is_batch_normalize=FLAG,
                                rollout_rs=_or_null(TEXT), rollout_rs_threshold=_or_null(_THRESHOLD),
                                bypass_mode=FLAG, loss_type=TEXT))
_BETAS = Takes("two numbers in [0, 1)", lambda v: isinstance(v, list) and len(v) == 2
               and all(_is_number(b) and 0 <= b < 1 for b in v))
# build_optimizer imports optimizer_impl by name and instantiates its class ``optimizer``: torch's own alone
_OPTIMIZER = Takes("the name of a class of torch.optim", lambda v: isinstance(v, str) and v.isidentifier())
_TARGET_MODULES = Takes("a string or a list of strings", lambda v: isinstance(v, str) or NAMES.ok(v))
_TILED_MLP = _entries("tiled MLP table", enabled=FLAG, num_shards=_integer(1))

FIELDS: dict[str, dict[str, Field]] = {
    "actor": {
        "_target_": _TARGET,
        "strategy": _contract(_STRATEGY),
        "ppo_mini_batch_size": _irrelevant("the captured step holds its mini-batch's rows; the size reaches the "
                                           "loss as the captured global_batch_size"),
        "ppo_micro_batch_size": _irrelevant("deprecated; the engine reads micro_batch_size_per_gpu "
                                            "(verl.engine.micro_batch_size_per_gpu)"),
        "ppo_micro_batch_size_per_gpu": _irrelevant(_ENGINE_HERE.format("micro_batch_size_per_gpu")),
        "ppo_infer_micro_batch_size_per_gpu": _INFERENCE,
        "use_dynamic_bsz": _irrelevant(_ENGINE_HERE.format("use_dynamic_bsz")),
        "ppo_max_token_len_per_gpu": _irrelevant(_ENGINE_HERE.format("max_token_len_per_gpu")),
        "ppo_infer_max_token_len_per_gpu": _INFERENCE,
        "clip_ratio": _contract(_RATIO),
        "clip_ratio_low": _contract(_RATIO),
        "clip_ratio_high": _contract(_COEF),
        "freeze_vision_tower": _contract(FLAG),
        "policy_loss": _contract(_POLICY_LOSS),
        "clip_ratio_c": _contract(_number(1, above=True)),
        "loss_agg_mode": _contract(_LOSS_AGG),
        "loss_scale_factor": _contract(_or_null(_integer(1))),
        "entropy_coeff": _contract(_number()),
        "tau_pos": _contract(_number(0, above=True)),
        "tau_neg": _contract(_number(0, above=True)),
        "calculate_entropy": _contract(FLAG),
        "calculate_sum_pi_squared": _contract(FLAG),
        "use_kl_loss": _contract(FLAG),
        "use_prefix_grouper": _refused("the prefix-grouped forward is not replayed", _off),
        "use_torch_compile": _contract(FLAG),
        "kl_loss_coef": _contract(_COEF),
        "kl_loss_type": _contract(_KL),
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
        "param_offload": _contract(FLAG),
        "optimizer_offload": _contract(FLAG),
        "forward_only": _refused("an engine built forward-only performs no update", _off),
        "strategy": _contract(_STRATEGY),
        "dtype": _contract(_DTYPE),
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
        "full_determinism": _contract(FLAG),
        "router_replay": _refused("mixture-of-experts router replay is not replayed", _mode_disabled),
        "wrap_policy": _contract(TABLE),
        "offload_policy": _contract(FLAG),
        "reshard_after_forward": _contract(FLAG),
        "fsdp_size": _contract(_integer(1, also=(-1,))),
        "forward_prefetch": _contract(FLAG),
        "model_dtype": _contract(_DTYPE),
        "use_orig_params": _contract(FLAG),
        "mixed_precision": _knob("the dtypes FSDP2 computes (param_dtype, also autocast's) and reduces gradients "
                                 "(reduce_dtype) in: the same math, rounded at another precision, so the bits "
                                 "change (approximate claim; exact-input checks only the inputs); recorded as "
                                 "verl resolves it (unset: bf16, fp32, fp32); buffer_dtype, unused by FSDP2, is "
                                 "no knob (replayjob.runtime.knobs.VERL_PARAM_DTYPE, VERL_REDUCE_DTYPE)",
                                 _precision_table, "a table of param_dtype, reduce_dtype and buffer_dtype, each a "
                                 "dtype name verl reads (bf16, fp32, ...)", keys=("param_dtype", "reduce_dtype")),
        "ulysses_sequence_parallel_size": _SEQUENCE_PARALLEL,
        "entropy_from_logits_with_chunking": _contract(FLAG),
        "entropy_from_logits_chunk_size": _contract(_integer(1)),
        "use_torch_compile": _contract(FLAG),
        "entropy_checkpointing": _contract(FLAG),
        "use_no_sync_for_gradient_accumulation": _contract(FLAG),
        "pad_to_length": _contract(FLAG),
        "pad_to_length_bucket": _contract(_integer(1)),
        "qat": _QAT,
        "turbo_config": _refused("the fsdp_turbo engine is not replayed", _off),
    },
    "optim": {
        "_target_": _TARGET,
        "lr": _contract(_COEF),
        "lr_warmup_steps_ratio": _contract(_RATIO),
        "total_training_steps": _contract(_integer(-1)),
        "weight_decay": _contract(_COEF),
        "lr_warmup_steps": _contract(_or_null(_integer(-1))),
        "betas": _contract(_BETAS),
        "clip_grad": _contract(_number(0, above=True)),
        "grad_clip": _contract(_or_null(_number(0, above=True))),
        "optimizer": _contract(_OPTIMIZER),
        "optimizer_impl": _contract(_choice("torch.optim")),
        "min_lr_ratio": _contract(_or_null(_RATIO)),
        "warmup_style": _contract(_or_null(_SCHEDULER)),
        "lr_scheduler_type": _contract(_SCHEDULER),
        "num_cycles": _contract(_COEF),
        "override_optimizer_config": _contract(_or_null(TABLE)),
        "zero_indexed_step": _contract(FLAG),
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
        "override_config": _contract(TABLE),
        "enable_gradient_checkpointing": _knob("recomputes each layer's forward in backward with the RNG state "
                                               "restored (replayjob.runtime.knobs.VERL_GRADIENT_CHECKPOINTING)", _flag,
                                               "true or false"),
        "enable_activation_offload": _contract(FLAG),
        "use_remove_padding": _knob("the model-side switch of verl.engine.use_remove_padding, declared with "
                                    "it (replayjob.runtime.knobs.VERL_REMOVE_PADDING_MODEL)", _flag, "true or false"),
        "lora_rank": _contract(_integer(0)),
        "lora_alpha": _contract(_integer(0)),
        "target_modules": _contract(_or_null(_TARGET_MODULES)),
        "target_parameters": _contract(_or_null(NAMES)),
        "exclude_modules": _contract(_or_null(TEXT)),
        "lora": _contract(TABLE),
        "lora_adapter_path": _refused("an adapter loaded from a path at build is not pinned; start LoRA from "
                                      "lora_rank (the capture pins the adapter as it is at the step)", _off),
        "use_liger": _refused("Liger kernels are not replayed", _off),
        "use_fused_kernels": _refused("verl's fused kernels (Triton) are not replayed", _off),
        "fused_kernel_options": _contract(TABLE),
        "tiled_mlp": _contract(_TILED_MLP),
        "architectures": _contract(_or_null(NAMES)),
        "mtp": _refused("multi-token prediction layers are not replayed", _not_enabled),
    },
}


def classify(section: str, name: str) -> Field | None:
    """The classification of ``verl.<section>.<name>``, or None when it is not classified."""
    return FIELDS.get(section, {}).get(name)


def value_reasons(section: str, name: str, value: Any) -> list[str]:
    """Why ``verl.<section>.<name> = value`` cannot be recorded or replayed (empty: it can), every reason: a refused
    field at a value it does not admit, a knob at a value it does not take, a contract field of another type or
    range than its declaration (:class:`Takes`; each entry of a table)."""
    f = classify(section, name)
    if f is None:
        return [f"verl.{section}.{name} is not classified for this verl version (contract, systems knob, irrelevant "
                "or refused)"]
    if f.kind == CONTRACT and f.spec is not None:
        return f.spec.reasons(f"verl.{section}.{name}", value)
    if f.kind == REFUSED and f.admitted is not None and not f.admitted(value):
        return [f"verl.{section}.{name} = {_shown(value)} is not replayed: {f.why}"]
    if f.kind == KNOB and f.valid is not None and not f.valid(value):
        return [f"verl.{section}.{name} is {_shown(value)}; it takes {f.takes}"]
    if (section, name) == ("engine", "mixed_precision") and value["param_dtype"] in _FP16:
        return ["verl.engine.mixed_precision.param_dtype = fp16 is not replayed: verl's gradient scaler (its scale "
                "and growth state) is not captured"]
    return []


def value_reason(section: str, name: str, value: Any) -> str | None:
    """:func:`value_reasons` as one sentence (``None``: the value can be recorded and replayed)."""
    why = value_reasons(section, name, value)
    return "; ".join(why) if why else None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def config_reasons(values: Any) -> list[str]:
    """Why a recorded (or resolved) ``verl`` config section is not one a capture writes (empty: it is): the loss and
    the four sections, each a table of exactly its recorded fields (no irrelevant or unknown field, none missing),
    each at a value its class admits (:func:`value_reasons`: a contract field of its declared type and range)."""
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
            why += value_reasons(section, name, sec[name])
    return why


def _taken(f: Field) -> str:
    spec = f.spec
    if spec is None:
        return "any value"
    if spec.entries is None:
        return spec.text
    inner = "; ".join(f"{k}: {_taken(Field(CONTRACT, spec=v))}" for k, v in spec.entries.items())
    return f"{spec.text.split(' (')[0]}, exactly its entries ({inner}){' or null' if spec.null else ''}"


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
            why = (f.why if f.kind != CONTRACT else f"defines the update's math; takes {_taken(f)}").replace("|", "\\|")
            rows.append(f"| `verl.{section}.{name}` | {f.kind} | {why} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
