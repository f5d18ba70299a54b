"""TRL integration: capture a real ``trl.GRPOTrainer`` (or ``trl.RLOOTrainer``) step, and replay it with TRL's
own training step.

Capture (``pip install 'replayjob[trl]'``), before ``train()``; ``cap.result.replay_toml`` is then
``runs/cap/replay.toml`` with its pins filled in:

    >>> from replayjob import capture_optimizer_batch  # doctest: +SKIP
    >>> trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained("/models/base"), ...,  # doctest: +SKIP
    ...                       peft_config=LoraConfig(...))
    >>> cap = capture_optimizer_batch(trainer, "runs/cap", step=1)  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
    >>> cap.result.replay_toml  # doctest: +SKIP

``steps=[K1, K2, ...]`` instead captures several steps of the run
(:class:`~replayjob.producers.api.capture.ChosenSteps`): per step its files and
``replay_step_<K:06d>.toml``, and ``metrics.json`` once training ends (``cap.steps_result``).

Under ``accelerate launch`` or ``torchrun`` (DDP) the same call in every process captures step K over all of
them (:mod:`replayjob.producers.api.parts`: one part per process in ``rank-<r>/``, one root written by process 0);
a replay runs on any process count (``replayjob replay --nproc N``), each process taking its contiguous run
of the captured micro-batches, and another count than the capture's is the knob ``distributed.num_processes``,
admitted per loss type where TRL's normalisation keeps the gradient (:func:`knob_refusals`).

How it plugs in: a ``TrainerCallback`` snapshots the adapter, optimizer and LR-scheduler state at
``on_step_begin`` of (each chosen) global step K and finishes the capture at ``on_step_end``, after the
transformers loop's clip, ``optimizer.step()``, ``lr_scheduler.step()`` and ``zero_grad()``;
the trainer's ``compute_loss`` is wrapped so every micro-batch's inputs (exactly the dict TRL's
loss receives, after generation and buffering) and the Torch RNG state are recorded right before
the loss call, and ``training_step`` so its reported loss is accumulated as the transformers loop
logs it (:class:`LoggedLoss`).  Nothing else changes: the
wrappers read state and consume no random numbers.

Replay (:func:`build_replay`) loads the base model from its directory, builds a ``GRPOTrainer``
with the captured ``GRPOConfig`` values (plus declared systems-only overrides), a reward function
and a dataset that refuse to be used, and generation disabled; it stands the trainer at step K
(``_prepare_for_training``, the scheduler built for the captured ``max_steps``) and runs each
micro-batch through ``trainer.training_step`` (TRL's ``compute_loss``), then the transformers
loop's ``_clip_grad_norm`` / ``_get_grad_norm``, ``optimizer.step()``, ``lr_scheduler.step()``
and ``model.zero_grad()``.  This module imports TRL, transformers and peft only inside functions,
so ``explain`` can use :func:`contract` without them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.artifacts.capture_root import rank_dir
from replayjob.errors import RefusedError, UsageError
from replayjob.jsonio import read_json_object
from replayjob.model import moe
from replayjob.producers.api import capture as cap
from replayjob.producers.api import files as _files
from replayjob.producers.api import microbatch as _microbatch
from replayjob.producers.api import parts as iranks
from replayjob.producers.api import precision
from replayjob.producers.api.admission import Admission
from replayjob.producers.api.replay import ReplaySession
from replayjob.producers.contract import integration_contract
from replayjob.producers.trl import fields as trl_fields
from replayjob.redact import REDACTED
from replayjob.runtime import knobs
from replayjob.runtime.distributed import launch_env

if TYPE_CHECKING:
    import torch


FRAMEWORK = "trl"
TESTED = {"trl": "1.16.0"}
# The TRL trainers a capture takes, each with its config class; a capture of another than GRPOTrainer records the
# class in its config (TRAINER_KEY) and contract.
TRAINERS = {"GRPOTrainer": "GRPOConfig", "RLOOTrainer": "RLOOConfig"}
TRAINER_KEY = "trl_trainer"
# Every GRPOConfig / RLOOConfig field is classified in trl_fields.FIELDS (contract, knob, irrelevant, refused): the
# contract, what a replay's trainer is built with and what a capture may not set all come from that one table.


class _Refused(RuntimeError):
    """Raised if a replay ever reaches generation, a reward function or the dataset."""


def jsonable(value: Any) -> Any:
    """A framework config value as JSON: enums by value, sets sorted, tuples as lists, others by repr."""
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, set | frozenset):
        return sorted(jsonable(v) for v in value)
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return repr(value)


def _trl_config(args: Any) -> dict[str, Any]:
    d = jsonable(args.to_dict())
    for key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        if key in d and isinstance(d[key] or {}, dict):
            # None, {} and {"use_reentrant": None} all mean the library default; recording the key
            # explicitly makes the reentrant variant one addressable knob (use_reentrant = true/false).
            d[key] = {"use_reentrant": None, **(d[key] or {})}
    out: dict[str, Any] = d
    return out


# transformers' current checkpointing names and their deprecated twins (``TrainingArguments`` resolves one from the
# other and then mirrors it): one setting, recorded under both names, compared and declared under the old one.
KNOB_ALIASES = {"activation_checkpointing": "gradient_checkpointing",
                "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs"}


def canonical_names(captured: dict[str, Any], overrides: dict[str, Any],
                    allowed: list[str]) -> tuple[dict[str, Any], list[str], list[str]]:
    """Overrides and declared keys with ``activation_checkpointing*`` under the name replayjob compares,
    ``gradient_checkpointing*`` (either works); refusal reasons when both names are set to different values."""
    out, why = dict(overrides), []
    for alias, name in KNOB_ALIASES.items():
        if alias not in out or name not in captured:
            continue  # a capture without the old name (another transformers) keeps the new one as it is
        value = out.pop(alias)
        if name in out and out[name] != value:
            why.append(f"{FRAMEWORK}.{alias} and {FRAMEWORK}.{name} name one transformers setting; they are set to "
                       f"different values ({value!r} vs {out[name]!r}): set one of them")
        out[name] = value
    prefixes = {f"{FRAMEWORK}.{a}": f"{FRAMEWORK}.{n}" for a, n in KNOB_ALIASES.items()}
    keys = []
    for key in allowed:
        for alias, name in prefixes.items():
            if (key == alias or key.startswith(alias + ".")) and name.split(".", 1)[1] in captured:
                key = name + key[len(alias):]
        keys.append(key)
    return out, sorted(set(keys)), why


def mirror_aliases(values: dict[str, Any]) -> dict[str, Any]:
    """The resolved framework config with each ``activation_checkpointing*`` key equal to its twin, as
    ``TrainingArguments`` leaves them."""
    out = dict(values)
    for alias, name in KNOB_ALIASES.items():
        if alias in out and name in out:
            out[alias] = out[name]
    return out


def ignored(key: str) -> bool:
    """Keys never compared: the ``activation_checkpointing*`` mirrors (their twins are compared)."""
    return any(key == f"{FRAMEWORK}.{a}" or key.startswith(f"{FRAMEWORK}.{a}.") for a in KNOB_ALIASES)


# What a TRL capture writes in ``framework_state`` (``TRLCapture._begin`` and its notes); ``precision`` and ``routing``
# are notes a capture adds when it observed them.
STATE_KEYS = ("global_step", "max_steps", "logprobs", "launch")
STATE_NOTES = ("precision", "routing")
LOGPROB_SOURCES = {"sampling_per_token_logps": "sampler", "old_per_token_logps": "trainer_old"}


def framework_state_reasons(state: dict[str, Any], groups: list[Any], step: int, processes: int) -> list[str]:
    """Why the recorded ``framework_state`` is not what a TRL capture of step ``step`` on ``processes`` processes
    writes, or cannot rebuild the trainer at that step: exactly its keys (:data:`STATE_KEYS`, and the notes
    :data:`STATE_NOTES`), ``global_step`` present (the replay stands the trainer's counter at it), ``max_steps`` an
    integer above it (the schedule the replay's LR scheduler is built for: a step at or after it is never reached),
    ``launch.processes`` the processes the manifest says ran it, ``logprobs`` the record ``mismatch`` reads (its
    counters, and each source one of :data:`LOGPROB_SOURCES`) and the notes tables."""
    def count(v: Any, least: int) -> bool:
        return type(v) is int and least <= v < 2**63

    out = [f"framework_state.{k} is no key a TRL capture writes (it writes {', '.join(STATE_KEYS + STATE_NOTES)})"
           for k in sorted(set(state) - set(STATE_KEYS) - set(STATE_NOTES))]
    if "global_step" not in state:  # its value is the manifest's step (the manifest's reader compares them)
        out.append(f"framework_state.global_step is missing (the trainer's step counter, {step} at the captured step)")
    got = state.get("max_steps")
    if not count(got, step + 1):
        out.append(f"framework_state.max_steps is {repr(got)[:24]}, not an integer above the captured step {step} "
                   "(the trainer's max_steps the replay builds its LR schedule for)")
    launch = state.get("launch")
    if not (isinstance(launch, dict) and sorted(launch) == ["processes", "requested_processes"]
            and launch["processes"] == processes and type(launch["processes"]) is int
            and (launch["requested_processes"] is None or (launch["requested_processes"] == processes
                 and type(launch["requested_processes"]) is int))):
        out.append(f"framework_state.launch is {launch!r:.80}, not the record of a step run on {processes} "
                   f"process{'es' if processes != 1 else ''} (processes {processes}; requested_processes the same, "
                   "or null without a launcher)")
    lp = state.get("logprobs")
    if not (isinstance(lp, dict) and sorted(lp) == ["generate_every", "micro_step", "sources"]
            and count(lp["micro_step"], 0) and count(lp["generate_every"], 1) and isinstance(lp["sources"], dict)
            and all(LOGPROB_SOURCES.get(k) == v for k, v in lp["sources"].items())):
        out.append(f"framework_state.logprobs is {lp!r:.80}, not the record of the step's logprob sources "
                   "(micro_step an integer >= 0, generate_every an integer >= 1, sources naming "
                   + " or ".join(f"{k}: {v!r}" for k, v in LOGPROB_SOURCES.items()) + ")")
    out += [f"framework_state.{k} is {state[k]!r:.40}, not a table (a note the capture writes as one)"
            for k in STATE_NOTES if k in state and not isinstance(state[k], dict)]
    return out


def recorded_reasons(adm: Admission, src: dict[str, Any]) -> list[str]:
    """Where the recorded TRL config contradicts the rest of the capture (each value already of its domain): the
    ``max_steps`` the replay's schedule is built for (``framework_state.max_steps``), the micro-batches' rows (each
    one ``per_device_train_batch_size``'s), the generation batch (whole groups of ``num_generations``), the
    completions' width (at most ``max_completion_length``), the two names of the checkpointing setting, the vLLM
    correction's ratio (an input of every micro-batch) and the precision record (``bf16``/``fp16``).  (The device
    is recorded only in the manifest's ``producer`` provenance, which decides nothing, and not in a root's.)"""
    m, mbs = adm.manifest, adm.micro_batches
    if m is None:
        return []
    why, state = [], m.doc["framework_state"]
    if src["max_steps"] > 0 and state.get("max_steps") != src["max_steps"]:  # -1: the trainer derived it
        why.append(f"trl.max_steps is {src['max_steps']}, but framework_state.max_steps is "
                   f"{repr(state.get('max_steps'))[:24]} (one trainer's max_steps)")
    size, spg, gen = src["per_device_train_batch_size"], src["steps_per_generation"], src.get("num_generations")
    if gen is not None and (size * spg * adm.captured_processes) % gen:
        why.append(f"the generation batch (per_device_train_batch_size {size} x steps_per_generation {spg} x "
                   f"{adm.captured_processes} process(es)) is not whole groups of num_generations {gen}")
    if "activation_checkpointing" in src and src["activation_checkpointing"] not in (None,
                                                                                    src["gradient_checkpointing"]):
        why.append(f"trl.activation_checkpointing is {src['activation_checkpointing']!r}, but "
                   f"trl.gradient_checkpointing is {src['gradient_checkpointing']!r} (one setting under two names)")
    key = trl_fields.OPTIM_GROUP_KEYS.get(src["optim"])
    groups = m.doc["optimizer"]["param_groups"]
    if key is not None and any(isinstance(g, dict) and key not in g for g in groups):
        why.append(f"trl.optim is {src['optim']!r}, but the captured optimizer's param groups hold no {key!r} (the "
                   "state of another optimizer)")
    prec = state.get("precision")
    mixed = "bf16" if src["bf16"] else "fp16" if src["fp16"] else "no"
    if isinstance(prec, dict) and prec.get("mixed_precision") != mixed:
        why.append(f"trl.bf16 is {src['bf16']!r} and trl.fp16 {src['fp16']!r}, but framework_state.precision "
                   f"records mixed precision {str(prec.get('mixed_precision'))[:24]!r} (TRL's {mixed!r})")
    for i, mb in enumerate(mbs or []):
        rows = _microbatch.batch_rows([mb])
        if rows != size:
            why.append(f"micro-batch {i} holds {rows} rows, but trl.per_device_train_batch_size is {size} (each "
                       "micro-batch of a step is one per_device_train_batch_size slice of the generation batch)")
            break
        ids = mb.inputs.get("completion_ids")
        if ids is not None and ids.dim() == 2 and int(ids.shape[1]) > src["max_completion_length"]:
            why.append(f"micro-batch {i}'s completions are {int(ids.shape[1])} tokens wide, beyond "
                       f"trl.max_completion_length {src['max_completion_length']}")
            break
        if (src["use_vllm"] and src.get("vllm_importance_sampling_correction")
                and "importance_sampling_ratio" not in mb.inputs):
            why.append(f"trl.use_vllm and vllm_importance_sampling_correction are on, but micro-batch {i} holds no "
                       "importance_sampling_ratio (the ratio the corrected loss multiplies by)")
            break
    return [f"{r}; the capture contradicts itself (recapture the step)" for r in why]


def _combination_reasons(t: dict[str, Any]) -> list[str]:
    """The setting combinations GRPOTrainer refuses when it is built (a ValueError): vespo's loss with the vLLM
    correction takes a token-level correction mode.  (The loss type and importance-sampling level pairs it only warns
    about, luspo at token level, vespo at sequence level, a summing loss at sequence level, train as configured and
    are admitted.)"""
    mode = t.get("vllm_importance_sampling_mode")
    if (t.get("loss_type") == "vespo" and t.get("use_vllm") is True and t.get("vllm_importance_sampling_correction")
            is True and mode not in ("token_truncate", "token_mask")):
        return [f"trl.loss_type 'vespo' with the vLLM correction takes vllm_importance_sampling_mode 'token_truncate' "
                f"or 'token_mask', not {mode!r} (GRPOTrainer refuses it)"]
    return []


def knob_refusals(adm: Admission) -> list[str]:
    """Why a declared TRL knob does not hold for this capture and replay (beyond being present and registered)."""
    t = (adm.resolved or {}).get(FRAMEWORK, {})
    trainer = str((adm.resolved or {}).get(TRAINER_KEY) or "GRPOTrainer")
    src = adm.manifest.config.get(FRAMEWORK) if adm.manifest is not None else None
    # the recorded config and the replay's, each read through the fields' declared domains (trl_fields.DOMAINS): the
    # checks below and the replay's trainer read their values
    recorded = trl_fields.config_reasons(src, trainer)
    why = [f"the capture's config: {r}; the capture contradicts itself (recapture the step)" for r in recorded]
    why += [r for r in trl_fields.config_reasons(t, trainer) if r not in recorded]  # each reason once
    if why:
        return why
    why = (recorded_reasons(adm, src) if isinstance(src, dict) else []) + _combination_reasons(t)
    for key in adm.observed:  # an override the table calls irrelevant: say so, and what the replay runs instead
        f = trl_fields.FIELDS.get(key.removeprefix(f"{FRAMEWORK}.").split(".")[0])
        mine = key.startswith(f"{FRAMEWORK}.") and key not in adm.allowed
        if mine and f is not None and f.kind == trl_fields.IRRELEVANT:
            why.append(f"{key} is irrelevant to the update ({f.reason}): the replay runs TRL's default for it "
                       "whatever the config says; remove the override")
    if knobs.TRL_USE_REENTRANT in adm.allowed and t.get("gradient_checkpointing") is not True:
        why.append(f"declared difference {knobs.TRL_USE_REENTRANT!r} is not present: the replay runs without "
                   "activation checkpointing, so no checkpoint function (reentrant or not) runs; declare it with "
                   f"{knobs.TRL_GRADIENT_CHECKPOINTING} = true or remove it")
    if knobs.TRL_MICRO_BATCH in adm.allowed:
        why += _resplit_refusals(adm)
    if NUM_PROCESSES in adm.allowed:
        why += _process_refusals(adm)
    else:
        why += [f"{k} is admitted only with {NUM_PROCESSES} (a process-count change): alone it changes the weight "
                "of each micro-batch's loss" for k in (knobs.TRL_ACCUMULATION, knobs.TRL_STEPS_PER_GENERATION)
                if k in adm.allowed]
    return why


# Several processes (DDP).  A replay runs on any process count; each process takes a contiguous run of the captured
# micro-batches in rank order (each restoring the RNG state captured before its own loss call) and DDP averages the
# processes' gradients.  The process count is compared as the config key distributed.num_processes; a change is
# admitted where TRL's normalisation keeps the gradient (docs/capture-api.md, "Several processes"): every captured
# micro-batch is run whole (replay processes x gradient_accumulation_steps = the captured micro-batches), the
# generation batch is kept (processes x steps_per_generation), and for the losses whose normaliser names the
# process count (dapo, cispo, vespo: num_items_in_batch / num_processes x current_gradient_accumulation_steps /
# steps_per_generation) the ratio gradient_accumulation_steps / steps_per_generation is kept.
RANKS = True
NUM_PROCESSES = knobs.NUM_PROCESSES
PROCESS_EXACT = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo")  # divided by the accumulation steps alone
PROCESS_RATIO = ("dapo", "cispo", "vespo")  # divided by num_items_in_batch / num_processes x acc / spg
_PROCESS_GEOMETRY = ("gradient_accumulation_steps", "steps_per_generation")


def _process_refusals(adm: Admission) -> list[str]:
    m, r, mbs = adm.manifest, adm.resolved, adm.micro_batches
    if m is None or r is None or mbs is None:
        return []  # refused already, for another reason
    src, t, key = m.config.get(FRAMEWORK, {}), r.get(FRAMEWORK, {}), NUM_PROCESSES
    p, p2, n = adm.captured_processes, adm.processes, len(mbs)
    acc, spg = (int(src[k]) for k in _PROCESS_GEOMETRY)
    acc2, spg2 = (int(t[k]) for k in _PROCESS_GEOMETRY)
    why = []
    if knobs.TRL_MICRO_BATCH in adm.allowed:
        why.append(f"{key}: a process-count change and {knobs.TRL_MICRO_BATCH} are not admitted together")
    if r.get(TRAINER_KEY):
        why.append(f"{key}: a process-count change is admitted for GRPOTrainer's loss types only, not "
                   f"{r[TRAINER_KEY]}")
    if p2 * acc2 != n:
        fix = (f"set {FRAMEWORK}.gradient_accumulation_steps = {n // p2} (declared)" if n % p2 == 0
               else f"choose a process count that divides {n}")
        why.append(f"{key}: the capture holds {n} micro-batches ({p} process(es) x {acc} accumulation steps); "
                   f"{p2} process(es) x gradient_accumulation_steps {acc2} would run {p2 * acc2}, so each would not "
                   f"be run exactly once with its weight: {fix}")
    loss = t.get("loss_type")
    if loss in PROCESS_RATIO and acc * spg2 != acc2 * spg:
        why.append(f"{key}: loss_type {loss!r} divides each micro-batch's loss by num_items_in_batch / "
                   "num_processes x current_gradient_accumulation_steps / steps_per_generation, and DDP averages "
                   "over the processes, so the gradient is kept only with gradient_accumulation_steps / "
                   f"steps_per_generation kept: captured {acc}/{spg}, replay {acc2}/{spg2} would scale it by "
                   f"{acc * spg2 / (acc2 * spg):g}" + (f"; set {FRAMEWORK}.steps_per_generation = {spg * acc2 // acc} "
                                                       "(declared)" if (spg * acc2) % acc == 0 else ""))
    elif loss not in PROCESS_RATIO and loss not in PROCESS_EXACT:
        why.append(f"{key}: loss_type {loss!r} is not covered (admitted: " + ", ".join(PROCESS_EXACT + PROCESS_RATIO)
                   + ")")
    elif p * spg != p2 * spg2:
        why.append(f"{key}: the generation batch (processes x steps_per_generation x per_device_train_batch_size) "
                   f"changes from {p} x {spg} to {p2} x {spg2}; GRPOConfig derives it from the process count: set "
                   f"{FRAMEWORK}.steps_per_generation = {p * spg // p2} (declared)")
    if t.get("use_adaptive_entropy"):
        why.append(f"{key}: the adaptive entropy controller tracks a window over the processes")
    return why


# The micro-batch knob: one step's captured rows re-split into micro-batches of another size.  Admitted for the loss
# types whose normalisation makes the split exact (with equal micro-batch sizes): each micro-batch's loss is a sum
# over its rows divided by (its rows x the accumulation steps), by (its rows x max_completion_length x the
# accumulation steps), or (dapo) by num_items_in_batch / num_processes x current_gradient_accumulation_steps /
# steps_per_generation, a ratio the replay keeps by scaling steps_per_generation with the accumulation steps.
RESPLIT_EXACT = ("grpo", "dr_grpo", "sapo", "luspo", "dapo")
RESPLIT_REFUSED = {
    "bnpo": "bnpo divides each micro-batch's loss by that micro-batch's own token count, so regrouped rows are "
            "weighted differently",
}
_GEOMETRY = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation")


def resplit_geometry(source: dict[str, Any], replay: dict[str, Any], rows: int) -> dict[str, int]:
    """The batch geometry the replay's trainer runs for the captured ``rows``: the replay's
    ``per_device_train_batch_size`` and the accumulation steps and ``steps_per_generation`` the registry's
    ``predict`` hooks derive from it (:func:`replayjob.runtime.knobs.trl_geometry`), the hooks ``reduce`` and the funnel
    expect the observed values from."""
    src = {f"{FRAMEWORK}.{k}": int(source[k]) for k in _GEOMETRY}
    arm = {f"{FRAMEWORK}.{k}": int(replay[k]) for k in _GEOMETRY}
    out = {k: arm[f"{FRAMEWORK}.{k}"] for k in _GEOMETRY}
    for k in _GEOMETRY[1:]:  # the derived knobs, each through its own hook
        key = f"{FRAMEWORK}.{k}"
        out[k] = int(knobs.KNOBS[key].expected(arm[key], rows, arm, src))
    return out


def _row_inputs(mb: _microbatch.MicroBatch) -> tuple[int, list[str]]:
    """A micro-batch's rows and the names of its per-row inputs (tensors whose first dimension is the rows)."""
    rows = _microbatch.batch_rows([mb])
    return rows, sorted(k for k, t in mb.inputs.items() if t.dim() > 0 and int(t.shape[0]) == rows)


def resplit(mbs: list[_microbatch.MicroBatch], size: int, accumulation_steps: int) -> list[_microbatch.MicroBatch]:
    """The captured micro-batches' rows, in order, as micro-batches of ``size`` rows, each run with
    ``accumulation_steps``; inputs that are not per-row (equal in every captured micro-batch, checked at
    admission) are shared, and each new micro-batch restores the RNG state of the captured one its first row
    came from (dropout is off: nothing in the loss draws from it)."""
    import torch
    _, per_row = _row_inputs(mbs[0])
    joined = {k: torch.cat([mb.inputs[k] for mb in mbs]) for k in per_row}
    first_rows = [0]
    for mb in mbs:
        first_rows.append(first_rows[-1] + _microbatch.batch_rows([mb]))
    total = first_rows[-1]
    out = []
    for start in range(0, total, size):
        src = max(i for i in range(len(mbs)) if first_rows[i] <= start)
        ins = {**mbs[0].inputs, **{k: t[start:start + size].clone() for k, t in joined.items()}}
        out.append(_microbatch.MicroBatch(ins, dict(mbs[0].input_values), dict(mbs[0].call), dict(mbs[0].call_values),
                                  dict(mbs[src].rng), start + size >= total, accumulation_steps))
    return out


def _resplit_refusals(adm: Admission) -> list[str]:
    import torch
    m, r, mbs = adm.manifest, adm.resolved, adm.micro_batches
    if m is None or r is None or mbs is None:
        return []  # refused already, for another reason
    src, t = m.config.get(FRAMEWORK, {}), r.get(FRAMEWORK, {})
    key, why = knobs.TRL_MICRO_BATCH, []
    if r.get(TRAINER_KEY):
        return [f"{key}: re-splitting is admitted for GRPOTrainer's loss types only, not {r[TRAINER_KEY]}"]
    loss = t.get("loss_type")
    if loss in RESPLIT_REFUSED or loss not in RESPLIT_EXACT:
        why.append(f"{key}: loss_type {loss!r} does not make a re-split exact ("
                   + RESPLIT_REFUSED.get(str(loss), "only " + ", ".join(RESPLIT_EXACT) + " are admitted") + ")")
    if t.get("entropy_coef") or t.get("use_adaptive_entropy"):
        why.append(f"{key}: the entropy bonus divides by each micro-batch's own token count")
    if (t.get("top_entropy_quantile") or 1.0) < 1.0:
        why.append(f"{key}: top_entropy_quantile < 1 masks by a quantile of each micro-batch's entropies")
    dropouts = []
    lora = (r.get("peft") or {}).get("lora_dropout")
    if isinstance(lora, int | float) and lora > 0:
        dropouts.append(f"peft.lora_dropout={lora}")
    try:
        base = read_json_object(Path(str(r["model"]["path"])) / "config.json", follow_symlinks=True)
        dropouts += [f"model config {d}" for d in knobs.config_dropouts(base)]
    except RefusedError:
        pass  # the base model check names it
    if dropouts:
        why.append(f"{key}: dropout draws one random mask per micro-batch, so regrouping rows would redraw the "
                   "masks: " + ", ".join(dropouts))
    rows = _microbatch.batch_rows(mbs)
    new = t.get("per_device_train_batch_size")
    size, acc, spg = (src.get(k) for k in _GEOMETRY)
    if not isinstance(new, int) or isinstance(new, bool) or new < 1:
        return [*why, f"{key} must be an integer >= 1, found {new!r}"]
    if rows != size * acc or any(_microbatch.batch_rows([mb]) != size for mb in mbs):
        sizes = [_microbatch.batch_rows([mb]) for mb in mbs]
        why.append(f"{key}: the capture's {len(mbs)} micro-batches of {sizes} rows "
                   f"are not {acc} of {size} (the captured geometry)")
    elif rows % new or (size * spg) % new:
        why.append(f"{key}: {new} does not divide the step's {rows} rows and the generation batch's {size * spg} "
                   "rows into equal micro-batches (the admitted loss types are exact only with equal sizes)")
    per_row = {tuple(_row_inputs(mb)[1]) for mb in mbs}
    shared = [k for k in mbs[0].inputs if k not in _row_inputs(mbs[0])[1]]
    mixed = len(per_row) != 1 or any(
        mb.input_values != mbs[0].input_values or mb.call_values != mbs[0].call_values
        or sorted(mb.call) != sorted(mbs[0].call) or any(not torch.equal(mb.call[k], mbs[0].call[k]) for k in mb.call)
        or any(not torch.equal(mb.inputs[k], mbs[0].inputs[k]) for k in shared)
        or any(mb.inputs[k].shape[1:] != mbs[0].inputs[k].shape[1:] for k in _row_inputs(mbs[0])[1])
        for mb in mbs)
    if mixed:
        why.append(f"{key}: the captured micro-batches differ in inputs that are not per-row ({shared}) or in "
                   "padded widths (rows of different generation batches), so their rows cannot be regrouped")
    return why


def contract(resolved: dict[str, Any]) -> dict[str, Any]:
    """The TRL update's contract from a resolved config (pure: no TRL import)."""
    t = resolved.get(FRAMEWORK, {})
    update = {k: t.get(k) for k in trl_fields.contract_fields(t)}
    if resolved.get(TRAINER_KEY):  # RLOOTrainer: its own loss (a per-sequence mean); GRPO captures omit it
        if resolved[TRAINER_KEY] not in TRAINERS:
            raise RefusedError(f"unknown TRL trainer {resolved[TRAINER_KEY]!r}", where=TRAINER_KEY,
                               hint="replayjob replays " + ", ".join(TRAINERS))
        update["trainer"] = resolved[TRAINER_KEY]
    return integration_contract(FRAMEWORK, update, "training_step per captured micro-batch; clip (max_grad_norm "
                                "> 0); optimizer.step; lr_scheduler.step unless skipped; zero_grad",
                                dtype=resolved.get("model", {}).get("dtype"), adapter=resolved.get("peft"))


def _first_linear(model: Any) -> Any:
    """The first ``torch.nn.Linear`` of ``model`` (every forward calls one; PEFT calls the base model's ``forward``
    directly, so a hook on the model itself would not run), else the model."""
    import torch

    return next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), model)


def _base_model(trainer: Any) -> Any:
    model = trainer.model
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def capture_optimizer_batch(trainer: Any, out_dir: str | Path, step: int | None = None, *,
                            steps: Iterable[int] | None = None) -> TRLCapture:
    """Instrument a ``trl.GRPOTrainer`` before ``train()`` so optimizer step ``step`` (or each of ``steps``)
    is captured.  Steps are 0-based: step K starts at ``trainer.state.global_step == K`` and is the one TRL
    logs as ``step`` K+1.

    ``step=K`` writes one capture with ``replay.toml``, ``metrics.json`` and ``final_adapter/``
    (``result``); ``steps=[K1, K2, ...]`` writes per step its files and ``replay_step_<K:06d>.toml``,
    and when training ends one ``metrics.json`` with every captured step's pins (``steps_result``).
    With neither, step 0 is captured.
    Refused at once (nothing written): both ``step`` and ``steps``, a negative or
    repeated step, a step before the trainer's current step or at/after its ``max_steps``, a trainer
    that is not a GRPOTrainer or RLOOTrainer, a model without a PEFT adapter, a base model not loaded from a local
    directory with safetensors weights, or an output directory that already holds one of the files.
    """
    from peft import PeftModel
    from trl import GRPOTrainer, RLOOTrainer

    if step is not None and steps is not None:
        raise UsageError("give one of step=K (one step) and steps=[K, ...] (several steps), not both",
                         where="capture_optimizer_batch",
                         hint="e.g. capture_optimizer_batch(trainer, out, step=1) or (..., steps=[1, 3])")
    if step is None and steps is None:
        step = 0  # the first optimizer step, as before steps= existed
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"step must be an integer >= 0, found {step!r}", where="step")
    chosen = (step,) if step is not None else _files.chosen_steps(steps)
    if not isinstance(trainer, GRPOTrainer | RLOOTrainer):
        raise cap.CaptureError(f"expected a trl.GRPOTrainer or trl.RLOOTrainer, found {type(trainer).__name__}",
                               where="trainer")
    if not isinstance(trainer.model, PeftModel):
        raise cap.CaptureError("the trainer's model has no PEFT adapter", where="trainer.model",
                               hint="pass peft_config=LoraConfig(...) to GRPOTrainer (replayjob replays adapters)")
    past = [k for k in chosen if k < trainer.state.global_step]
    if past:
        raise cap.CaptureError(f"the trainer is already past step(s) {past}", where="step" if step is not None
                               else "steps")
    late = [k for k in chosen if 0 < trainer.args.max_steps <= k]
    if late:
        raise cap.CaptureError(f"step(s) {late} are not reached: the trainer's max_steps is {trainer.args.max_steps} "
                               "(steps are 0-based)", where="step" if step is not None else "steps",
                               hint="raise max_steps or choose earlier steps")
    return TRLCapture(trainer, Path(out_dir), chosen, several=steps is not None)


class LoggedLoss:
    """A step's loss as the transformers loop logs it: each micro-batch's ``training_step`` loss added to a
    float32 tensor on the trainer's device (``Trainer._tr_loss``), then gathered over the ranks and averaged
    (``nested_gather(...).mean().item()``): at ``logging_steps=1`` equal to the logged ``loss``."""

    def __init__(self, device: Any):
        import torch
        self.total = torch.tensor(0.0, device=device)

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss.detach()

    def value(self, parallel_mode: Any) -> float:
        from transformers.trainer_pt_utils import nested_gather

        return float(nested_gather(self.total, parallel_mode).mean().item())


def logprob_record(trainer: Any) -> dict[str, Any]:
    """What a capture records about the step's logprob sources, for ``replayjob mismatch``: the trainer's
    micro-step at the step's start and its generation period (which say whose weights generated each
    micro-batch), and the logprob inputs this run produces, named by source: ``sampler``
    (``sampling_per_token_logps``, vLLM or a ``rollout_func`` only) and ``trainer_old``
    (``old_per_token_logps``: the trainer's own, when generations are reused or the vLLM correction is on)."""
    args = trainer.args
    every = int(args.steps_per_generation) * int(trainer.num_iterations)
    vllm_correction = bool(getattr(trainer, "use_vllm", False)) and bool(
        getattr(trainer, "vllm_importance_sampling_correction", False))
    sources = {}
    if getattr(trainer, "use_vllm", False) or getattr(trainer, "rollout_func", None) is not None:
        sources["sampling_per_token_logps"] = "sampler"
    if int(args.gradient_accumulation_steps) % every != 0 or vllm_correction:
        sources["old_per_token_logps"] = "trainer_old"
    return {"micro_step": int(getattr(trainer, "_step", 0)), "generate_every": every, "sources": sources}


class TRLCapture:
    """The instrumentation :func:`capture_optimizer_batch` installs: ``result`` once step K finished
    (``step=K``), ``steps_result`` once training ended (``steps=[...]``)."""

    def __init__(self, trainer: Any, out_dir: Path, steps: tuple[int, ...], *, several: bool):
        from transformers import TrainerCallback

        base = _base_model(trainer)
        self.trainer, self.steps, self.several = trainer, steps, several
        self.step = steps[0]  # the one step of a step=K capture (the first chosen one otherwise)
        peft_cfg = trainer.model.peft_config[trainer.model.active_adapter]
        config = {
            FRAMEWORK: _trl_config(trainer.args),
            "model": {"path": str(Path(str(base.config._name_or_path)).resolve()) if base.config._name_or_path
                      else "", "attn_implementation": base.config._attn_implementation,
                      "dtype": str(base.dtype).removeprefix("torch.")},
            "peft": jsonable(peft_cfg.to_dict()),
        }
        from trl import GRPOTrainer

        if not isinstance(trainer, GRPOTrainer):  # an RLOOTrainer (a GRPO capture's config stays as it was)
            config[TRAINER_KEY] = "RLOOTrainer"
        # several processes (DDP): each captures its own micro-batches as a part (integrations.ranks)
        self.rank, self.world = int(trainer.accelerator.process_index), int(trainer.accelerator.num_processes)
        self._root: cap.CaptureResult | None = None
        # how many processes the launcher was asked for, where it says (torchrun and `accelerate launch --multi_gpu`
        # set WORLD_SIZE; `accelerate launch --cpu --num_processes N` runs the script once and says nothing)
        requested = launch_env().world_size if launch_env().launched else None
        if requested is not None and requested != self.world:
            raise cap.CaptureError(f"the launcher started {requested} processes (WORLD_SIZE) but the trainer runs on "
                                   f"{self.world}", where="trainer.accelerator",
                                   hint="build the trainer inside the launched processes (see docs/capture-api.md, "
                                        "'Several processes', for launch lines that work)")
        self._launch = {"requested_processes": requested, "processes": self.world}
        if self.world > 1:
            config["distributed"] = {"num_processes": self.world}  # one-process captures record none
            kind = str(getattr(trainer.accelerator.distributed_type, "value", trainer.accelerator.distributed_type))
            if not kind.startswith("MULTI_"):  # DDP; FSDP and DeepSpeed shard the adapter or optimizer state
                raise cap.CaptureError(f"a capture over several processes takes data-parallel (DDP) runs; this one "
                                       f"runs {kind}", where="trainer.accelerator",
                                       hint="capture a DDP run (accelerate launch / torchrun without FSDP or "
                                            "DeepSpeed); see docs/capture-api.md, 'Several processes'")
        self._cap: cap.StepCapture | None = None  # the step being captured (or the last one)
        self._config = config
        self._base_dir = str(base.config._name_or_path or "")
        self._out = out_dir
        self._chosen: cap.ChosenSteps | None = None
        self._base_model: dict[str, Any] | None = None  # step=K: hashed here, once
        if several and self.world > 1:
            raise cap.CaptureError(f"steps=[...] is captured in one process; this run has {self.world}",
                                   where="steps", hint="capture one step (step=K) of a run over several processes")
        if self.world > 1:
            iranks.refuse_existing(out_dir, self.rank, self.step)
            self._base_model = _files.base_model_identity(self._base_dir)
        elif several:  # refused now, before training: existing files, a base model not in a local directory
            self._chosen = cap.ChosenSteps(out_dir, steps=steps, framework=FRAMEWORK, base_model_dir=self._base_dir,
                                           config=config)
        else:
            _files.refuse_existing(out_dir, _files.capture_file_names(self.step, several=False))
            self._base_model = _files.base_model_identity(self._base_dir)
        handle = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                handle._begin(state)

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                c = handle._cap
                if c is not None and c.active and state.global_step == c.step + 1:
                    c.note("precision", precision.of_trainer(handle.trainer, handle._probe.seen))
                    handle._routing_note(c)
                    c.loss = handle._loss.value(args.parallel_mode)  # gathered over the processes
                    c.finish(grad_norm=handle._grad_norm)
                    if handle.world > 1:  # land; process 0 writes the root
                        handle._root = iranks.finish(handle._out, c, handle.rank, handle.world)

            def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                c = handle._cap
                if c is not None and c.active:
                    c.abandon()  # the step never completed: nothing was written for it
                if handle._chosen is not None:
                    handle._chosen.close()  # metrics.json, last

        self._grad_norm: float | None = None
        self._routing: moe.Routing | None = None  # the captured step's routing observer (an MoE model)
        self._routed_rows = 0
        self._loss = LoggedLoss(trainer.args.device)
        # the precision the step's loss forward really ran in (accelerate's autocast wraps the model's forward):
        # observed on the first linear layer of the first loss call's forward, recorded as framework_state.precision
        self._probe = precision.Probe(_first_linear(base), getattr(trainer.args.device, "type", "cpu"))
        self._wrap()
        trainer.add_callback(_Callback())

    def _begin(self, state: Any) -> None:
        k, t = state.global_step, self.trainer
        live = {"model": t.model, "optimizer": t.optimizer, "scheduler": t.lr_scheduler,
                "framework_state": {"global_step": k, "max_steps": state.max_steps, "logprobs": logprob_record(t),
                                    "launch": self._launch}}
        if self._chosen is not None:
            c = self._chosen.at(k, **live)
        elif k == self.step and self._cap is None:
            part = self.world > 1
            c = cap.StepCapture(self._out / rank_dir(self.rank) if part else self._out, step=k, framework=FRAMEWORK,
                                base_model_dir=self._base_dir, config=self._config, base_model=self._base_model,
                                part=part, **live)
        else:
            c = None
        if c is not None:
            self._cap, self._grad_norm, self._loss = c, None, LoggedLoss(t.args.device)
            self._probe.seen = None
            c.begin()
            # an MoE model's routing of the captured step (one process, one step: docs/moe.md), recorded over the
            # sequence each loss call's forward receives
            self._routing = moe.record(t.model) if self.world == 1 and not self.several else None
            self._routed_rows = 0
            if self._routing is not None:
                self._routing.begin_update()

    def _routing_note(self, c: cap.StepCapture) -> None:
        """Write the captured step's routing (``routing_step_<K>.safetensors``, recorded on the step's logical batch)
        and note its pin in the manifest's ``framework_state.routing`` (the manifest, written next, pins it)."""
        routing, self._routing = self._routing, None
        if routing is None:
            return
        routing.end_update()
        if routing.last is None:
            return
        name = moe.source_step_file(c.step)
        table = dataclasses.replace(routing.last, identity={"logical_batch_sha256":
                                                            _microbatch.logical_digest(c.micro_batches)})
        c.note("routing", {"path": name, "sha256": moe.write_table(self._out / name, table)})

    def _wrap(self) -> None:
        t: Any = self.trainer
        compute_loss, training_step, get_grad_norm = t.compute_loss, t.training_step, t._get_grad_norm

        def recording_compute_loss(model: Any, inputs: dict[str, Any], *a: Any, **kw: Any) -> Any:
            c = self._cap
            if c is not None and c.active:
                c.record(inputs, {"num_items_in_batch": kw.get("num_items_in_batch")},
                         sync_gradients=bool(t.accelerator.sync_gradients),
                         accumulation_steps=int(t.current_gradient_accumulation_steps))
                if len(c.micro_batches) == 1:  # the loss's own forward (generation ran earlier, outside autocast)
                    self._probe.arm()
                _, mask = sequence(inputs)
                if self._routing is not None and mask is not None:
                    first, self._routed_rows = self._routed_rows, self._routed_rows + int(mask.shape[0])
                    with self._routing.micro_batch(list(range(first, self._routed_rows)), mask):
                        return compute_loss(model, inputs, *a, **kw)
            return compute_loss(model, inputs, *a, **kw)

        def summing_training_step(*a: Any, **kw: Any) -> Any:
            loss = training_step(*a, **kw)
            c = self._cap
            if c is not None and c.active:
                self._loss.add(loss)
            return loss

        def noting_grad_norm(*a: Any, **kw: Any) -> Any:
            g = get_grad_norm(*a, **kw)
            c = self._cap
            if c is not None and c.active:
                self._grad_norm = float(g) if g is not None else None
            return g

        t.compute_loss, t.training_step, t._get_grad_norm = (recording_compute_loss, summing_training_step,
                                                             noting_grad_norm)

    @property
    def result(self) -> cap.CaptureResult:
        """The finished capture of ``step=K``; refused when step K has not run (train() ended earlier)."""
        if self._chosen is not None:
            raise cap.CaptureError("several steps were captured; their results are in steps_result",
                                   where=str(self._out), hint="use steps_result.step(K) or steps_result.captured")
        if self._cap is None or self._cap.result is None:
            raise cap.CaptureError(f"optimizer step {self.step} was not captured (training ended before it "
                                   "completed)", where=str(self._out), hint="train for at least step + 1 steps")
        if self.world > 1:
            assert self._root is not None
            return self._root
        return self._cap.result

    @property
    def steps_result(self) -> cap.StepsResult:
        """The capture of ``steps=[...]`` once training ended: captured steps, those never completed
        (``not_captured``; ``step(K)`` refuses them) and metrics.json; refused before ``train()`` ended."""
        if self._chosen is None:
            raise cap.CaptureError("one step was captured (step=K); its result is in result", where=str(self._out))
        if self._chosen.result is None:
            raise cap.CaptureError("training has not ended: metrics.json is written when train() returns",
                                   where=str(self._out), hint="read steps_result after trainer.train()")
        return self._chosen.result


# -- replay -----------------------------------------------------------------------------------------

def _placeholder_dataset() -> Any:
    """The dataset a replay's trainer is built with (GRPOTrainer requires one): one empty in-memory
    row whose every read raises (a transform), because a replay reads no dataset."""
    from datasets import Dataset

    ds = Dataset.from_dict({"prompt": [""]})
    ds.set_transform(_no_dataset)
    return ds


def _no_dataset(*args: Any, **kwargs: Any) -> Any:
    raise _Refused("a replay read the dataset")


def _no_reward(*args: Any, **kwargs: Any) -> list[float | None]:
    raise _Refused("a replay called a reward function")


def _no_generation(*args: Any, **kwargs: Any) -> Any:
    raise _Refused("a replay tried to generate completions")


_ALIASES = KNOB_ALIASES


def _grpo_config(values: dict[str, Any], out: Path, config_class: str = "GRPOConfig") -> Any:
    """A GRPOConfig (or ``config_class``) built from the captured (and overridden) values, checked to come out equal.

    Only the contract and knob fields are passed (:func:`trl_fields.replayed_fields`); the fields irrelevant to the
    update (generation, rewards, logging, ...) take TRL's defaults, so the replay never depends on them (a capture
    with two reward functions and their ``reward_weights`` replays with one stand-in that refuses to be called).
    transformers' deprecated ``gradient_checkpointing*`` names are the ones replayjob compares (an override
    under the current ``activation_checkpointing*`` name is moved to them at admission,
    :func:`canonical_names`); their ``activation_checkpointing*`` twins are set from them.  Redacted values are not
    passed.  Any passed field the installed TRL resolves to another value than the capture's is refused.
    """
    import trl

    config_cls = getattr(trl, config_class)
    fields = {f.name for f in dataclasses.fields(config_cls) if f.init}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise RefusedError(f"captured GRPOConfig keys {unknown[:5]} are unknown to the installed TRL",
                           where="trl", hint="replay with the TRL version the capture recorded")
    replayed = set(trl_fields.replayed_fields())
    kwargs = {k: v for k, v in values.items() if k in replayed and v != REDACTED}
    for alias, name in _ALIASES.items():
        if name in values:
            kwargs[alias] = values[name]
    for key in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        kwargs[key] = {k: v for k, v in (kwargs.get(key) or {}).items() if v is not None} or None
    kwargs["use_vllm"] = False  # never start vLLM: the sampler's part is in the captured inputs (_sampler_correction)
    args = config_cls(output_dir=str(out / "trainer"), report_to=[], **kwargs)
    built = _trl_config(args)
    off = sorted(k for k, v in values.items()
                 if k in replayed and k not in (*_ALIASES, "use_vllm") and v != REDACTED and built.get(k) != v)
    if off:
        raise RefusedError(f"the installed TRL resolves GRPOConfig {off[:5]} to other values than the capture "
                           f"({[built.get(k) for k in off[:5]]} vs {[values[k] for k in off[:5]]})", where="trl",
                           hint="replay with the TRL version the capture recorded")
    return args


def _sampler_correction(trainer: Any, values: dict[str, Any]) -> None:
    """Apply vLLM's importance-sampling correction as the source did, on a trainer built without vLLM.

    ``GRPOTrainer`` builds its vLLM generation object when ``use_vllm`` is set, so the replay's trainer is built
    with it off; its ``_compute_loss`` multiplies by the captured ``importance_sampling_ratio`` only when
    ``use_vllm`` and ``vllm_importance_sampling_correction`` are both true, so ``use_vllm`` is restored on the
    trainer (the correction settings were set from the captured config).  Generation stays disabled."""
    trainer.use_vllm = bool(values.get("use_vllm", False))


class TRLSession(ReplaySession):
    """A GRPOTrainer stood at the captured step (see the module docstring)."""

    def __init__(self, adm: Admission, out: Path):
        import torch
        import trl
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM, AutoTokenizer

        m, r = adm.manifest, adm.resolved
        assert m is not None and r is not None
        base = str(r["model"]["path"])
        dtype = getattr(torch, str(r["model"]["dtype"]))
        model: Any = AutoModelForCausalLM.from_pretrained(
            base, dtype=dtype, local_files_only=True, use_safetensors=True,
            attn_implementation=r["model"]["attn_implementation"])
        try:
            tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise RefusedError(f"the base model directory has no loadable tokenizer ({exc})", where=base,
                               hint="save the tokenizer next to the weights (GRPOTrainer needs one to be "
                                    "built; the replay never tokenises)") from None
        peft = {k: v for k, v in r["peft"].items() if k in {f.name for f in dataclasses.fields(LoraConfig)}}
        mbs = adm.micro_batches or []
        self.geometry = resplit_geometry(m.config[FRAMEWORK], r[FRAMEWORK], _microbatch.batch_rows(mbs))
        kind = str(r.get(TRAINER_KEY) or "GRPOTrainer")
        args = _grpo_config({**r[FRAMEWORK], **self.geometry}, out, TRAINERS[kind])
        trainer: Any = getattr(trl, kind)(model=model, reward_funcs=[_no_reward], args=args,
                                   train_dataset=_placeholder_dataset(), processing_class=tok,
                                   peft_config=LoraConfig(**peft))
        _sampler_correction(trainer, r[FRAMEWORK])
        trainer._generate_and_score_completions = _no_generation
        trainer._generate = _no_generation
        trainer._prepare_inputs = lambda inputs: inputs  # the captured dict is what _prepare_inputs returned
        if args.activation_checkpointing:  # as Trainer.train() does before the loop
            gc_kwargs = dict(args.activation_checkpointing_kwargs or {})
            every, offload = gc_kwargs.pop("every_n_layers", 1), gc_kwargs.pop("offload", False)
            trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs=gc_kwargs or None,
                                                          every_n_layers=every, offload=offload)
        state = m.doc["framework_state"]
        trainer.state.max_steps = int(state["max_steps"])
        wrapped, _ = trainer._prepare_for_training(int(state["max_steps"]), None, None)
        trainer.state.global_step = int(state["global_step"])
        wrapped.zero_grad()
        # several processes: DDP wraps the model; the adapter is read and written on the trainer's own model
        self.rank, self.world = int(trainer.accelerator.process_index), int(trainer.accelerator.num_processes)
        self.trainer, self.wrapped = trainer, wrapped
        self.model = trainer.model if self.world > 1 else wrapped
        if self.world > 1:
            self.trace_refusal = self.repeat_refusal = f"it runs on {self.world} processes"
        self.optimizer, self.scheduler = trainer.optimizer, trainer.lr_scheduler
        self.device = trainer.args.device
        self._loss = LoggedLoss(self.device)
        self._before_loss: Callable[[], None] = _no_generation
        compute_loss, backward = trainer.compute_loss, trainer.accelerator.backward

        def restoring_compute_loss(model: Any, inputs: dict[str, Any], *a: Any, **kw: Any) -> Any:
            self._before_loss()
            return compute_loss(model, inputs, *a, **kw)

        def timed_backward(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return backward(*a, **kw)
            finally:
                self.backward_wall_s += time.perf_counter() - t0

        trainer.compute_loss = restoring_compute_loss
        trainer.accelerator.backward = timed_backward

    def run(self, mb: _microbatch.MicroBatch, inputs: dict[str, Any], call: dict[str, Any],
            before_loss: Callable[[], None]) -> float:
        t = self.trainer
        t.accelerator.gradient_state._set_sync_gradients(mb.sync_gradients)
        t.current_gradient_accumulation_steps = mb.accumulation_steps
        self._before_loss = before_loss
        ctx = contextlib.nullcontext() if mb.sync_gradients else t.accelerator.no_sync(model=self.wrapped)
        with ctx:
            loss = t.training_step(self.wrapped, inputs, call.get("num_items_in_batch"))
        self._loss.add(loss)
        return float(loss)

    def regroup(self, mbs: list[_microbatch.MicroBatch]) -> list[_microbatch.MicroBatch]:
        """The captured micro-batches, re-split (:func:`resplit`) when the micro-batch knob changes their size; over
        several processes (or from a capture over several) this process's contiguous run of them in rank order,
        each with the replay's accumulation steps and gradients synchronised with the last."""
        size, acc = self.geometry["per_device_train_batch_size"], self.geometry["gradient_accumulation_steps"]
        if not all(_microbatch.batch_rows([mb]) == size for mb in mbs):
            return resplit(mbs, size, acc)
        if self.world == 1 and self.adm.rank_micro_batches is None:
            return mbs
        mine = mbs[self.rank * acc:(self.rank + 1) * acc]
        return [dataclasses.replace(mb, accumulation_steps=acc, sync_gradients=i == len(mine) - 1)
                for i, mb in enumerate(mine)]

    def reported_loss(self, summed: float) -> float:
        """The step's loss as the transformers loop logs it (:class:`LoggedLoss`), not the float sum."""
        return self._loss.value(self.trainer.args.parallel_mode)

    def optimizer_step(self) -> float:
        import torch
        from transformers.trainer import GreedyLR

        t = self.trainer
        grad_norm = t._clip_grad_norm(self.wrapped) if t.args.max_grad_norm > 0 else None
        grad_norm = t._get_grad_norm(self.wrapped, grad_norm=grad_norm)
        t.optimizer.step()
        if not t.accelerator.optimizer_step_was_skipped and not isinstance(
                t.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau | GreedyLR):
            t.lr_scheduler.step()
        self.wrapped.zero_grad()
        return float(grad_norm)

    def begin(self, n_micro_batches: int) -> None:
        super().begin(n_micro_batches)
        self._loss = LoggedLoss(self.device)

    def trace_inputs(self, mb: _microbatch.MicroBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The sequence TRL's loss feeds the model (:func:`sequence`)."""
        return sequence(mb.inputs)

    def gradient_checkpointing(self, runtime: dict[str, Any]) -> bool:
        return bool(runtime.get(knobs.TRL_GRADIENT_CHECKPOINTING))

    def observe(self, rows: tuple[int, ...]) -> knobs.Runtime:
        """TRL's knobs are observed on the trainer's own (PEFT) model and the trainer."""
        return knobs.Runtime(self.trainer.model, rows, trainer=self.trainer)


def sequence(inputs: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The sequence TRL's loss feeds the model: prompt and completion ids, and their masks, side by side (what a
    trace keys rows by and the routing's tokens are; ``None`` where the inputs are not a GRPOTrainer's)."""
    import torch
    if not all(k in inputs for k in ("prompt_ids", "completion_ids", "prompt_mask", "completion_mask")):
        return None, None
    return (torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1))


def build_replay(adm: Admission, out: Path) -> TRLSession:
    """The integration registry's entry point: TRL's trainer stood at the captured step."""
    return TRLSession(adm, out)
