"""The manifest of an external trainer's capture: what pins one optimizer step, written last.

The one capture manifest schema (:data:`replayjob.artifacts.capture_manifest.SCHEMA`) as the capture API writes it
(``framework`` one of replayjob.producers.EXTERNAL; canonical JSON, one object)::

    schema, framework, step      producer framework (one of replayjob.producers.EXTERNAL), 0-based step
    producer                     replayjob, python, device, versions of the stack, determinism snapshot
    files                        payload, adapter, optimizer: each {file (bare name), size, sha256}
    micro_batches                per micro-batch, in the order the loss saw them: inputs and call,
                                 each {tensors: {name: {dtype, shape}}, values: {name: JSON}}; rng
                                 (the Torch RNG states taken right before the loss call);
                                 sync_gradients; accumulation_steps
    optimizer                    param_groups, per-parameter non-tensor state, the tensor keys in
                                 the optimizer file, and the LR scheduler's state (or null)
    trainable                    names of the trainable (adapter) parameters, in optimizer order
    framework_state              what the framework needs to stand its trainer at this step
    rows                         micro_batches, tensors, elements, bytes of the captured inputs, and
                                 nonfinite_inputs (a float input holds NaN/Inf: replayed only under
                                 optimizer_batch.allow_nonfinite_inputs)
    logical_batch_sha256         digest of every input of every micro-batch (capture.logical_digest)
    local_effective_rows_sha256  the same plus each micro-batch's RNG and accumulation settings
    config                       resolved (redacted) and its sha256: {<framework>, model, peft, stack}
    contract                     what defines the update's math (redacted) and its sha256
    base_model                   path, files {name: sha256} (config and safetensors weights), sha256
    outcome                      the real update as it returned: loss, grad_norm (null when not finite or
                                 not given) and final_adapter_sha256 (the adapter after it, in the bytes
                                 save_adapter writes); what reduce compares metrics.json's numbers with
                                 (absent only in captures written before it)

The payload holds ``mb0000.inputs.<key>``, ``mb0000.call.<key>`` and ``mb0000.rng.<cpu|cuda.N>``;
the adapter file the trainable parameters by name just before the step; the optimizer file
``state.<index>.<key>``.  A reader hashes the manifest's bytes against the pin before parsing
(:func:`replayjob.artifacts.capture_manifest.read_pinned`), then reads it through its declaration
(:class:`ApiManifest`): every field typed and bounded (free-form JSON too: no integer beyond 64 bits), no key
unknown or missing, the embedded digests and the row counts recomputed and a difference refused.
A step captured over several processes has one such manifest per process (in ``rank-<r>/``) and a root of
the same schema that lists them in ``ranks`` (:mod:`replayjob.producers.api.parts`), declared by
:class:`ApiRoot`; :func:`of` checks it against its parts (their rows summed, their payloads' digest).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from replayjob.artifacts.capture_manifest import (
    FINITE,
    LOGPROB,
    MASK,
    OUTCOME,
    SCHEMA,
    WEIGHT,
    ContractBlock,
    Domain,
    Hashed,
    Outcome,
    PinnedManifest,
    check_schema,
    decode_manifest,
    file_stem,
    read_pinned,
)
from replayjob.artifacts.capture_root import landed_name, rank_dir, ranks_digest
from replayjob.declaration import INT64_MAX, INT64_MIN, Count, Digest, Document, Positive, Text, agree
from replayjob.digest import sha256_bytes, sha256_json
from replayjob.errors import IntegrityError
from replayjob.frameworks import EXTERNAL
from replayjob.fsio import atomic_write_bytes, check_no_symlinks, read_regular_bytes
from replayjob.jsonio import canonical_bytes, loads_strict

FILES = ("payload", "adapter", "optimizer")
#: ``producer.device``: the device of the trainable parameters the step updated, as torch names it
DEVICE = re.compile(r"(cpu|cuda|mps|xpu|npu|hpu|xla)(:\d{1,5})?")


def file_names(step: int) -> dict[str, str]:
    """The capture's file names for ``step``: payload, adapter, optimizer and the manifest."""
    stem = file_stem(step)
    return {"payload": f"{stem}.safetensors", "adapter": f"{stem}.adapter.safetensors",
            "optimizer": f"{stem}.optimizer.safetensors", "manifest": f"{stem}.manifest.json"}


#: a token id indexes the vocabulary (>= 0; the base model's ``vocab_size`` bounds it above at admission) and a count
#: of tokens is >= 0
TOKEN_ID = Domain("a token id is >= 0 (an index into the vocabulary)", ge=0.0)
COUNT = Domain("a count is >= 0", ge=0.0)

#: the domain of each per-token or per-row input a producer's captured step holds, by producer and the input's name
#: (in ``inputs`` or ``call``), enforced on the payload by :func:`input_domain_reasons` for every capture of that
#: producer: TRL's GRPO batch (``GRPOTrainer._generate_and_score_completions``: the masks 0/1, padding 0; the
#: logprobs padded with 0.0) and verl's update batch (the rollout's logprobs padded with -1).  A plain loop's inputs
#: are named and read by its own loss, so none is declared beyond the rule every float input follows (finite unless
#: flagged ``rows.nonfinite_inputs`` and opted into).
INPUT_DOMAINS: dict[str, dict[str, Domain]] = {
    "trl": {"old_per_token_logps": LOGPROB, "ref_per_token_logps": LOGPROB, "sampling_per_token_logps": LOGPROB,
            "old_logps": LOGPROB, "prompt_mask": MASK, "completion_mask": MASK, "tool_mask": MASK,
            "importance_sampling_ratio": WEIGHT, "advantages": FINITE, "prompt_ids": TOKEN_ID,
            "completion_ids": TOKEN_ID, "num_items_in_batch": COUNT},
    "verl": {"old_log_probs": LOGPROB, "ref_log_prob": LOGPROB, "rollout_log_probs": LOGPROB,
             "response_mask": MASK, "attention_mask": MASK, "rollout_is_weights": WEIGHT, "advantages": FINITE},
    "torch": {},
}

#: the dtypes an input of each kind is held in (the manifest's ``dtype`` names): ids and counts integers, masks integers
#: or booleans, log-probabilities, advantages and weights floating point
_KINDS = {"int": ("int64", "int32", "int16", "int8", "uint8"),
          "mask": ("int64", "int32", "int16", "int8", "uint8", "bool"),
          "float": ("float32", "float64", "bfloat16", "float16")}

#: the inputs a producer's loss reads, by producer: each name's kind (:data:`_KINDS`), the shapes it takes (``R`` the
#: micro-batch's rows, ``P`` the prompt's padded length, ``C`` the completion's, a number that length) and whether
#: every micro-batch holds it.  TRL's GRPOTrainer and RLOOTrainer (``_generate_and_score_completions``): prompt and
#: completion ids with masks of their shapes, per-token log-probabilities and masks of the completion's shape,
#: advantages per row (or per token).  A real step's micro-batch holds nothing else of these names in another shape
#: or dtype, and never lacks a required one (the loss reads it); inputs not listed here (a multimodal model's pixel
#: values) are the loss's own.
INPUT_LAYOUTS: dict[str, dict[str, tuple[str, tuple[tuple[str | int, ...], ...], bool]]] = {
    "trl": {
        "prompt_ids": ("int", (("R", "P"),), True), "prompt_mask": ("mask", (("R", "P"),), True),
        "completion_ids": ("int", (("R", "C"),), True), "completion_mask": ("mask", (("R", "C"),), True),
        "advantages": ("float", (("R",), ("R", 1), ("R", "C")), True),
        "old_per_token_logps": ("float", (("R", "C"),), False), "ref_per_token_logps": ("float", (("R", "C"),), False),
        "sampling_per_token_logps": ("float", (("R", "C"),), False), "tool_mask": ("mask", (("R", "C"),), False),
        "importance_sampling_ratio": ("float", (("R", "C"), ("R", 1)), False),
        "old_logps": ("float", (("R",),), False), "num_items_in_batch": ("int", ((),), False),
    },
}

#: producers whose loss calls form one gradient-accumulation window per process (transformers' Trainer: each of a
#: step's micro-batches runs with ``current_gradient_accumulation_steps`` = the window's micro-batches, gradients
#: synchronised with the last only), with the config key bounding the window's length
WINDOWS: dict[str, tuple[str, str]] = {"trl": ("trl", "gradient_accumulation_steps")}


def input_layout_reasons(framework: str, tensors: dict[str, Any]) -> list[str]:
    """Why a micro-batch's ``inputs`` tensor specs (``{name: {dtype, shape}}``, or TensorSpec) are not what the
    producer's loss reads (:data:`INPUT_LAYOUTS`): a required input missing, one of another dtype kind, or shapes
    that do not fit together (the rows, the prompt's and the completion's lengths shared by every input)."""
    layout = INPUT_LAYOUTS.get(framework)
    if layout is None:
        return []
    specs = {k: (v.dtype, list(v.shape)) if isinstance(v, TensorSpec) else (str(v["dtype"]), list(v["shape"]))
             for k, v in tensors.items()}
    reasons = [f"inputs.{name} is missing: the {framework} loss reads it from every micro-batch"
               for name, (_, _, required) in sorted(layout.items()) if required and name not in specs]
    sizes: dict[str, int] = {}
    for name in sorted(layout, key=lambda n: not layout[n][2]):  # the required ids and masks set R, P and C first
        if name not in specs:
            continue
        kind, shapes, _ = layout[name]
        dtype, shape = specs[name]
        if dtype not in _KINDS[kind]:
            reasons.append(f"inputs.{name} is {dtype[:24]}, not one of {list(_KINDS[kind])}")
            continue
        fits = [s for s in shapes if len(s) == len(shape) and all(
            (isinstance(d, int) and d == n) or (isinstance(d, str) and sizes.get(d, n) == n)
            for d, n in zip(s, shape, strict=True))]
        if not fits:
            known = ", ".join(f"{d}={n}" for d, n in sorted(sizes.items()))
            reasons.append(f"inputs.{name} has shape {shape[:4]}, not one of "
                           + " or ".join("[" + ", ".join(map(str, s)) + "]" for s in shapes)
                           + (f" ({known})" if known else ""))
            continue
        sizes.update({d: n for d, n in zip(fits[0], shape, strict=True) if isinstance(d, str)})
    return reasons


def input_domain_reasons(framework: str, group: str, tensors: dict[str, Any]) -> list[str]:
    """Why a captured micro-batch's ``group`` (``inputs`` or ``call``) holds a value outside its input's declared
    domain (:data:`INPUT_DOMAINS`): one reason per input, naming it, the first row and position and the rule."""
    import torch
    reasons = []
    for name, dom in sorted(INPUT_DOMAINS.get(framework, {}).items()):
        t = tensors.get(name)
        if not isinstance(t, torch.Tensor) or t.dtype == torch.bool or t.is_complex():
            continue
        flat = t.detach().reshape(-1)
        a = (flat.to(torch.float64) if t.is_floating_point() else flat.to(torch.int64)).numpy()
        found = dom.first_outside(a)
        if found is None:
            continue
        i, value = found
        width = math.prod(t.shape[1:]) if t.dim() > 1 else 1
        at = f"row {i // width}, position {i % width}" if t.dim() > 1 else f"element {i}"
        reasons.append(dom.reason(f"{group}.{name}", value, at))
    return reasons


@dataclass(frozen=True)
class Manifest(PinnedManifest):
    """A verified integration capture manifest."""

    @property
    def step(self) -> int:
        return int(self.doc["step"])

    def file(self, role: str) -> Path:
        return self.path.parent / str(self.doc["files"][role]["file"])

    def file_sha256(self, role: str) -> str:
        return str(self.doc["files"][role]["sha256"])

    @property
    def initial_adapter_sha256(self) -> str:
        return self.file_sha256("adapter")

    @property
    def payload_digest(self) -> str:
        """The payload pin replays record (``pins.payload_spans_sha256``): the payload file's SHA-256."""
        return self.file_sha256("payload")

    @property
    def micro_batches(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.doc["micro_batches"]
        return out


def build(*, framework: str, step: int, producer: dict[str, Any], files: dict[str, dict[str, Any]],
          micro_batches: list[dict[str, Any]], optimizer: dict[str, Any], trainable: list[str],
          framework_state: dict[str, Any], rows: dict[str, Any], logical: str, effective: str,
          config: dict[str, Any], contract: dict[str, Any], base_model: dict[str, Any],
          sealed: dict[str, Any]) -> dict[str, Any]:
    """One process's capture manifest document (nothing is written; :func:`write` validates and writes it);
    ``sealed`` its ``outcome`` (:func:`replayjob.artifacts.capture_manifest.outcome`)."""
    return {"schema": SCHEMA, "framework": framework, "step": step, "producer": producer, "files": files,
            "micro_batches": micro_batches, "optimizer": optimizer, "trainable": trainable,
            "framework_state": framework_state, "rows": rows, "logical_batch_sha256": logical,
            "local_effective_rows_sha256": effective, "config": {"sha256": sha256_json(config), "resolved": config},
            "contract": {"sha256": sha256_json(contract), "value": contract}, "base_model": base_model,
            OUTCOME: sealed}


def write(path: Path, doc: dict[str, Any]) -> str:
    """Validate, then write the manifest atomically and exclusively; return its SHA-256."""
    validate(doc, path)
    data = canonical_bytes(doc) + b"\n"
    atomic_write_bytes(path, data, exclusive=True)
    return sha256_bytes(data)


# ------------------------------------------------------------------------------------------ the declaration
_HINT = "the manifest is malformed; capture the step again"


def _is_bare(name: str) -> bool:
    """A file name next to the manifest: no directory part, not hidden, not empty, no backslash."""
    return name == Path(name).name and not name.startswith(".") and "\\" not in name and name not in ("", "..")


def _bounded(value: Any, field: str) -> None:
    """A free-form JSON block's numbers as every declared number: an integer within 64 bits, a float finite
    (strict JSON has no NaN, but a document built in memory is checked before it is written)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        v, at = stack.pop()
        if isinstance(v, dict):
            stack.extend((x, (*at, k)) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, (*at, i)) for i, x in enumerate(v))
        elif isinstance(v, int) and not isinstance(v, bool) and not INT64_MIN <= v <= INT64_MAX:
            text = str(v) if len(str(v)) <= 24 else str(v)[:24] + "..."
            raise ValueError(f"`{_path(field, at)}` is {text}, an integer beyond 64 bits")
        elif isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"`{_path(field, at)}` is {v!r}, not a finite number")


def _path(field: str, at: tuple[Any, ...]) -> str:
    return field + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in at)


class ApiFile(Document, frozen=True):
    """``files.<role>``: one of the capture's files, a bare ``.safetensors`` name next to the manifest."""

    file: Text
    size: Positive
    sha256: Digest

    def __post_init__(self) -> None:
        if not (_is_bare(self.file) and self.file.endswith(".safetensors")):
            raise ValueError(f"`file` must be a bare .safetensors file name, found {self.file[:80]!r}")


class ApiFiles(Document, frozen=True):
    """``files``: payload, adapter and optimizer (:data:`FILES`)."""

    payload: ApiFile
    adapter: ApiFile
    optimizer: ApiFile


class TensorSpec(Document, frozen=True):
    dtype: Text
    shape: list[Count]


class InputGroup(Document, frozen=True):
    """A micro-batch's ``inputs`` or ``call``: its tensors (dtype and shape; the payload holds them) and its
    JSON values."""

    OPAQUE: ClassVar[dict[str, str]] = {
        "values": "the loss call's non-tensor inputs as the trainer passed them, hashed into the logical digest "
                  "and handed back unchanged at replay (every number bounded as a declared one)",
    }

    tensors: dict[str, TensorSpec]
    values: dict[str, Any]

    def __post_init__(self) -> None:
        both = sorted(set(self.tensors) & set(self.values))
        if both:
            raise ValueError(f"{both[:5]} are both a tensor and a value (`tensors`, `values`)")
        _bounded(self.values, "values")


class MicroBatchEntry(Document, frozen=True):
    """One entry of ``micro_batches``: what one loss call saw, with the RNG states taken right before it."""

    inputs: InputGroup
    call: InputGroup
    rng: list[Text]
    sync_gradients: bool
    accumulation_steps: Positive

    def __post_init__(self) -> None:
        if "cpu" not in self.rng:
            raise ValueError("`rng` must list 'cpu'")


class OptimizerState(Document, frozen=True):
    """``optimizer``: the optimizer's state_dict less its tensors (in the optimizer file), and the LR
    scheduler's."""

    OPAQUE: ClassVar[dict[str, str]] = {
        "param_groups": "the optimizer's param_groups as its state_dict holds them, loaded back whole at replay "
                        "(every number bounded as a declared one)",
        "state": "per parameter, the optimizer's non-tensor state, loaded back whole at replay (every number "
                 "bounded as a declared one)",
        "scheduler": "the LR scheduler's state_dict, loaded back whole at replay (every number bounded as a "
                     "declared one; last_epoch is checked against the step)",
    }

    param_groups: list[dict[str, Any]]
    state: dict[str, dict[str, Any]]
    tensors: dict[str, list[Text]]
    scheduler: dict[str, Any] | None

    def __post_init__(self) -> None:
        _bounded(self.param_groups, "param_groups")
        _bounded(self.state, "state")
        _bounded(self.scheduler, "scheduler")


class ApiRows(Document, frozen=True):
    """``rows``: the captured inputs' sizes (``micro_batches``, ``tensors``, ``elements`` and ``rows`` are
    recomputed from ``micro_batches``; admission recomputes every one from the payload)."""

    rows: Count
    micro_batches: Count
    tensors: Count
    elements: Count
    bytes: Count
    nonfinite_inputs: bool = False  # absent in captures written before the flag: false


class RootRows(ApiRows, frozen=True):
    """A root's ``rows``: the parts' summed (recomputed from them), the flag always present."""

    nonfinite_inputs: bool


class BaseModelPin(Document, frozen=True):
    """``base_model``: where the base model was (redacted) and the SHA-256 of each of its files."""

    path: str
    files: Annotated[dict[str, Digest], msgspec.Meta(min_length=1)]
    sha256: Digest

    def __post_init__(self) -> None:
        bad = [k for k in self.files if not _is_bare(k)]
        if bad:
            raise ValueError(f"`files` keys must be bare file names, found {bad[0][:80]!r}")
        agree("sha256", self.sha256, sha256_json(self.files))


def _rows_of(micro_batches: list[MicroBatchEntry]) -> dict[str, int]:
    """What ``rows`` summarises of the micro-batches the manifest lists (:func:`~replayjob.producers.api.
    microbatch.rows_summary` less the byte count, which needs each dtype's width)."""
    specs = [(mb, s) for mb in micro_batches for g in (mb.inputs, mb.call) for s in g.tensors.values()]
    return {"micro_batches": len(micro_batches), "tensors": len(specs),
            "elements": sum(math.prod(s.shape) for _, s in specs),
            "rows": sum(max([s.shape[0] for s in mb.inputs.tensors.values() if s.shape] + [1])
                        for mb in micro_batches)}


class ApiManifest(Document, frozen=True):
    """One process's capture through the capture API (the module docstring lists its fields)."""

    OPAQUE: ClassVar[dict[str, str]] = {
        "producer": "provenance (versions, python, device, determinism), recorded for people; the pins decide "
                    "(every number bounded as a declared one)",
        "framework_state": "what the framework needs to stand its trainer at this step, handed back whole at "
                           "replay (every number bounded as a declared one; global_step is checked)",
    }

    schema: Literal["replayjob.capture_manifest/v3"]
    framework: Text
    step: Count
    producer: dict[str, Any]
    files: ApiFiles
    micro_batches: Annotated[list[MicroBatchEntry], msgspec.Meta(min_length=1)]
    optimizer: OptimizerState
    trainable: Annotated[list[Text], msgspec.Meta(min_length=1)]
    framework_state: dict[str, Any]
    rows: ApiRows
    logical_batch_sha256: Digest
    local_effective_rows_sha256: Digest
    config: Hashed
    contract: ContractBlock
    base_model: BaseModelPin
    outcome: Outcome

    def __post_init__(self) -> None:
        _framework(self.framework, "manifest")
        # the step names every file of the capture: a relabelled step is a contradiction
        named = file_names(self.step)
        for role in FILES:
            got = getattr(self.files, role).file
            if got != named[role]:
                raise ValueError(f"`files.{role}.file` is {got[:80]!r}, but {named[role]!r} is the name of step "
                                 f"{self.step}'s {role}")
        seen = self.framework_state.get("global_step", self.step)  # a trainer that records its own step counter
        if not isinstance(seen, int) or isinstance(seen, bool) or seen != self.step:
            raise ValueError(f"`step` is {self.step}, but framework_state.global_step is {str(seen)[:40]}")
        # an LR scheduler stepped with the optimizer (optimizer_step, Trainer) has stepped at most once per step
        # before this one (fewer where a loss scaler skipped a step); a producer stepping it otherwise keeps it
        # elsewhere
        sched = self.optimizer.scheduler
        epoch = sched.get("last_epoch", 0) if sched is not None else 0
        if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch > self.step:
            raise ValueError(f"`step` is {self.step}, but the captured LR scheduler has already stepped "
                             f"{str(epoch)[:24]} time(s) (optimizer.scheduler.last_epoch)")
        if len(set(self.trainable)) != len(self.trainable):
            raise ValueError("`trainable` must list distinct parameter names")
        off = [f"rows.{k} is {getattr(self.rows, k)}, its micro_batches give {v}"
               for k, v in _rows_of(self.micro_batches).items() if getattr(self.rows, k) != v]
        if off:
            raise ValueError("`rows` summarises the micro-batches it lists, but " + "; ".join(off))
        for i, mb in enumerate(self.micro_batches):
            why = input_layout_reasons(self.framework, dict(mb.inputs.tensors))
            if why:
                raise ValueError(f"`micro_batches[{i}]`: " + "; ".join(why[:3]))
        window = WINDOWS.get(self.framework)
        if window is not None:
            _window(self.micro_batches, self.config.resolved.get(window[0], {}).get(window[1])
                    if isinstance(self.config.resolved.get(window[0]), dict) else None, ".".join(window))
        _bounded(self.producer, "producer")
        _bounded(self.framework_state, "framework_state")
        _bounded(self.config.resolved, "config.resolved")
        _bounded(self.contract.value, "contract.value")
        device = self.producer.get("device")  # where the update ran: a replay of a plain loop rebuilds it there
        if not (isinstance(device, str) and DEVICE.fullmatch(device)):
            raise ValueError(f"`producer.device` is {repr(device)[:40]}, not a torch device the step ran on (such as "
                             "'cpu' or 'cuda:0')")


def _window(micro_batches: list[MicroBatchEntry], configured: Any, key: str) -> None:
    """One process's micro-batches as one gradient-accumulation window (:data:`WINDOWS`): each runs with the window's
    length as its ``accumulation_steps``, gradients synchronised with the last micro-batch only, and the window no
    longer than the configured accumulation steps (``key``; the last window of an epoch may be shorter)."""
    n = len(micro_batches)
    acc = sorted({mb.accumulation_steps for mb in micro_batches})
    if acc != [n]:
        raise ValueError(f"`micro_batches` lists {n} loss call(s) of one accumulation window, but their "
                         f"accumulation_steps are {acc[:4]} (each is the window's length, {n})")
    sync = [i for i, mb in enumerate(micro_batches) if mb.sync_gradients]
    if sync != [n - 1]:
        raise ValueError(f"`micro_batches` synchronise gradients at {sync[:4]}, but a window synchronises with its "
                         f"last micro-batch ({n - 1}) only")
    if isinstance(configured, int) and not isinstance(configured, bool) and n > configured:
        raise ValueError(f"`micro_batches` lists {n} loss calls, but config.resolved.{key} is {configured}: a step "
                         "runs at most that many")


def _framework(name: str, what: str) -> None:
    if name not in EXTERNAL:
        raise ValueError(f"`framework` must be one of {list(EXTERNAL)} in a capture API {what}, found "
                         f"{name[:40]!r}")


def validate(doc: Any, where: Path) -> dict[str, Any]:
    """One process's manifest read through its declaration (:class:`ApiManifest`): every field's presence,
    type and range, no unknown key, the embedded digests and the row counts recomputed; and its name is the
    one its step gives."""
    check_schema(doc, where)
    if OUTCOME not in doc:  # every capture of this schema seals its outcome (reduce compares with it)
        raise IntegrityError(f"manifest field `{OUTCOME}` is missing: the capture was written by an earlier release "
                             "and seals none of the numbers reduce compares with", where=where,
                             hint="capture the step again")
    decode_manifest(doc, ApiManifest, where)
    named = file_names(doc["step"])["manifest"]
    if where.name != named:
        raise IntegrityError(f"manifest field `step` is {doc['step']}, but the manifest is {where.name!r} (step "
                             f"{doc['step']}'s is {named!r})", where=where, hint=_HINT)
    return doc


def read_verified(path: str | Path, expected_sha256: str) -> Manifest:
    """Hash the manifest bytes, compare with the pin, and only then parse and validate them."""
    p, actual, doc = read_pinned(path, expected_sha256,
                                 hint="point optimizer_batch.replay_path at the capture's "
                                      "optimizer_batch_step_<K>.manifest.json (its replay.toml has it)")
    return Manifest(p, actual, validate(doc, p))


# ------------------------------------------------------------------------------------- a root over processes
_SAME = ("adapter", "optimizer")  # files every part holds with the same bytes (the ranks start equal)


class ApiRankEntry(Document, frozen=True):
    """One process's part as the root lists it."""

    rank: Count
    dir: Text
    manifest_sha256: Digest
    logical_batch_sha256: Digest
    micro_batches: Positive


class ApiRoot(Document, frozen=True):
    """The root of a capture over several processes: what it ties the parts with, and what they share
    (process 0's, compared with every part by :func:`of`)."""

    OPAQUE: ClassVar[dict[str, str]] = {
        "framework_state": "process 0's framework_state, compared whole with its part's (which is read through "
                           "ApiManifest) and handed back whole at replay",
    }

    schema: Literal["replayjob.capture_manifest/v3"]
    framework: Text
    step: Count
    world_size: Annotated[int, msgspec.Meta(ge=2, le=1 << 20)]
    ranks: list[ApiRankEntry]
    payload_sha256: Digest
    rows: RootRows
    logical_batch_sha256: Digest
    local_effective_rows_sha256: Digest
    config: Hashed
    contract: ContractBlock
    base_model: BaseModelPin
    framework_state: dict[str, Any]
    trainable: Annotated[list[Text], msgspec.Meta(min_length=1)]
    optimizer: OptimizerState
    outcome: Outcome

    def __post_init__(self) -> None:
        _framework(self.framework, "root")
        if len(self.ranks) != self.world_size:
            raise ValueError(f"`ranks` must list one entry per process: world_size is {self.world_size}, ranks "
                             f"lists {len(self.ranks)}")
        for r, e in enumerate(self.ranks):
            if e.rank != r or e.dir != rank_dir(r):
                raise ValueError(f"`ranks[{r}]` must be rank {r} in {rank_dir(r)!r}, found rank {e.rank} in "
                                 f"{e.dir[:40]!r}")
        listed = sum(e.micro_batches for e in self.ranks)
        if self.rows.micro_batches != listed:
            raise ValueError(f"`rows` summarises the parts it lists, but rows.micro_batches is "
                             f"{self.rows.micro_batches}, its ranks give {listed}")
        _bounded(self.framework_state, "framework_state")
        _bounded(self.config.resolved, "config.resolved")
        _bounded(self.contract.value, "contract.value")


@dataclass(frozen=True)
class RootManifest(Manifest):
    """The root of a capture over several processes, with every part verified (``parts``, in rank order).

    It reads as one capture: its files are process 0's (the initial adapter and optimizer state every part
    shares), its micro-batches every part's in rank order, its payload pin :data:`payload_sha256`."""

    parts: tuple[Manifest, ...] = ()

    @property
    def world_size(self) -> int:
        return int(self.doc["world_size"])

    def file(self, role: str) -> Path:
        return self.parts[0].file(role)

    def file_sha256(self, role: str) -> str:
        return self.parts[0].file_sha256(role)

    @property
    def payload_digest(self) -> str:
        return str(self.doc["payload_sha256"])

    @property
    def micro_batches(self) -> list[dict[str, Any]]:
        return [e for p in self.parts for e in p.micro_batches]


def processes(m: Manifest | None) -> int:
    """How many processes ran the captured step (1 for a one-process capture)."""
    return m.world_size if isinstance(m, RootManifest) else 1


def check_parts(parts: list[Manifest]) -> None:
    """The parts are one data-parallel step: same step, config, contract, base model, initial adapter,
    optimizer state and final adapter."""
    first = parts[0]
    for r, p in enumerate(parts[1:], start=1):
        same = {"step": p.step == first.step, "framework": p.framework == first.framework,
                "config": p.doc["config"]["sha256"] == first.doc["config"]["sha256"],
                "contract": p.doc["contract"]["sha256"] == first.doc["contract"]["sha256"],
                "base model": p.doc["base_model"]["sha256"] == first.doc["base_model"]["sha256"],
                "trainable parameters": p.doc["trainable"] == first.doc["trainable"],
                # under DDP every process runs the step's loss calls in lockstep (the all-reduce waits for each)
                "micro-batch count": len(p.micro_batches) == len(first.micro_batches),
                **{f"{role} state": p.file_sha256(role) == first.file_sha256(role) for role in _SAME},
                "final adapter": (p.doc[OUTCOME]["final_adapter_sha256"]
                                  == first.doc[OUTCOME]["final_adapter_sha256"])}
        off = [k for k, ok in same.items() if not ok]
        if off:
            raise IntegrityError(f"process {r}'s part differs from process 0's in {', '.join(off)}: the processes "
                                 "did not run one data-parallel step", where=p.path,
                                 hint="capture a data-parallel (DDP) run: every process starts from and ends "
                                      "with the same adapter")


# ------------------------------------------------------------------------------------- reading
def _check_listing(d: Path, world: int) -> None:
    want = {rank_dir(r) for r in range(world)} | {landed_name(r) for r in range(world)}
    have = {p.name for p in d.iterdir() if p.name.startswith(("rank-", "COMPLETE."))}
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        raise IntegrityError(f"the root lists {world} processes, the directory "
                             + (f"lacks {', '.join(missing)}" if missing else f"also holds {', '.join(extra)}"),
                             where=d, hint="capture again into a new directory; every process must land")


def _check_landed(d: Path, rank: int, world: int, sha: str) -> None:
    p = d / landed_name(rank)
    doc = loads_strict(read_regular_bytes(p, max_bytes=64 * 1024, follow_symlinks=False, what="landing record"),
                       where=p)
    if doc != {"rank": rank, "world_size": world, "manifest_sha256": sha}:
        raise IntegrityError(f"process {rank}'s landing record does not match the root", where=p)


def read_capture(path: str | Path, expected_sha256: str) -> Manifest:
    """The manifest at ``path`` pinned by ``expected_sha256``: a one-process capture's (as
    :func:`replayjob.artifacts.api_manifest.read_verified`), or a root with every part verified."""
    p, sha, doc = read_pinned(path, expected_sha256,
                              hint="point optimizer_batch.replay_path at the capture's "
                                   "optimizer_batch_step_<K>.manifest.json (its replay.toml has it)")
    return of(p, sha, doc)


def of(p: Path, sha: str, doc: Any) -> Manifest:
    """A capture API manifest whose bytes matched their pin: one process's (validated), or a root (it lists
    ``ranks``) with every part verified."""
    if not (isinstance(doc, dict) and "ranks" in doc):
        one = Manifest(p, sha, validate(doc, p))
        _whole(one)
        return one
    validate_root(doc, p)
    d, world = p.parent, int(doc["world_size"])
    _check_listing(d, world)
    parts = []
    for e in doc["ranks"]:
        _check_landed(d, e["rank"], world, e["manifest_sha256"])
        where = check_no_symlinks(d, d / e["dir"] / p.name, what=f"process {e['rank']}'s manifest")
        part = read_verified(where, e["manifest_sha256"])
        if part.logical_sha256 != e["logical_batch_sha256"] or len(part.micro_batches) != e["micro_batches"]:
            raise IntegrityError(f"process {e['rank']}'s part does not match the root's record", where=where)
        _check_part_files(d, part, e["rank"])
        parts.append(part)
    check_parts(parts)
    first = parts[0]
    for k in ("config", "contract", "base_model", "framework_state", "trainable", "optimizer", OUTCOME):
        if doc[k] != first.doc[k]:
            raise IntegrityError(f"the root's {k} is not process 0's", where=p)
    if doc["framework"] != first.framework or doc["step"] != first.step:
        raise IntegrityError("the root's framework or step is not process 0's", where=p)
    if doc["payload_sha256"] != ranks_digest([m.payload_digest for m in parts]):
        raise IntegrityError("the root's payload_sha256 is not the digest of its parts' payloads", where=p)
    summed = summed_rows([m.doc["rows"] for m in parts])
    off = [f"rows.{k} is {doc['rows'].get(k)!r}, its parts give {v!r}" for k, v in summed.items()
           if doc["rows"].get(k) != v]
    if off:
        raise IntegrityError("the root's row summary is not its parts': " + "; ".join(off), where=p,
                             hint="a summary is recomputed from what it summarises; capture the step again")
    return RootManifest(p, sha, doc, tuple(parts))


def _whole(m: Manifest) -> None:
    """A manifest read as a capture of its own (no root) is a one-process capture: one that records the step ran on
    several processes (``config.resolved.distributed.num_processes``, ``framework_state.launch.processes``) is one
    process's part of a capture over them, holding that process's micro-batches only, and replaying it alone would
    run a fraction of the step as the whole."""
    dist = m.config.get("distributed")
    launch = m.doc["framework_state"].get("launch")
    said = [("config.resolved.distributed.num_processes",
             dist.get("num_processes") if isinstance(dist, dict) else None),
            ("framework_state.launch.processes", launch.get("processes") if isinstance(launch, dict) else None)]
    for field, n in said:
        if isinstance(n, int) and not isinstance(n, bool) and n != 1:
            raise IntegrityError(f"manifest field `{field}` is {n}: this is one process's part of a capture over {n} "
                                 "processes (its micro-batches are that process's only), not a capture of its own",
                                 where=m.path, hint="replay the capture's root manifest (the directory above "
                                                    "rank-<r>/), which pins every part")


def summed_rows(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A root's ``rows`` recomputed from its parts': every count summed, ``nonfinite_inputs`` when any part's is."""
    counts = [f for f in ApiRows.__struct_fields__ if f != "nonfinite_inputs"]
    out: dict[str, Any] = {k: sum(int(r[k]) for r in parts) for k in counts}
    out["nonfinite_inputs"] = any(bool(r.get("nonfinite_inputs", False)) for r in parts)
    return out


def _check_part_files(d: Path, part: Manifest, rank: int) -> None:
    """Every file a part pins, whether or not a replay reads it (the initial adapter and optimizer state are read
    from process 0's part only): inside the capture, reached through no symbolic link, a regular file of its
    pinned size."""
    for role, spec in sorted(part.doc["files"].items()):
        f = check_no_symlinks(d, part.file(role), what=f"process {rank}'s {role} file")
        try:
            size = f.stat().st_size if f.is_file() else None
        except OSError:
            size = None
        if size is None:
            raise IntegrityError(f"process {rank}'s {role} file is missing (or not a regular file)", where=f,
                                 hint="keep every part of the capture together, as it was written")
        if size != spec["size"]:
            raise IntegrityError(f"process {rank}'s {role} file is {size} bytes, its manifest pins {spec['size']}",
                                 where=f, hint="the file changed after capture; capture the step again")


def build_root(parts: list[Manifest], micro_batches: list[int], *, rows: dict[str, Any], logical: str,
               effective: str) -> dict[str, Any]:
    """The root document over verified ``parts`` (process 0 first; ``micro_batches`` per part), with the
    digests over every part's micro-batches in rank order; what every part shares is process 0's."""
    first = parts[0]
    return {
        "schema": SCHEMA, "framework": first.framework, "step": first.step, "world_size": len(parts),
        "ranks": [{"rank": r, "dir": rank_dir(r), "manifest_sha256": p.sha256,
                   "logical_batch_sha256": p.logical_sha256, "micro_batches": n}
                  for r, (p, n) in enumerate(zip(parts, micro_batches, strict=True))],
        "payload_sha256": ranks_digest([p.payload_digest for p in parts]),
        "rows": rows, "logical_batch_sha256": logical, "local_effective_rows_sha256": effective,
        **{k: first.doc[k] for k in ("config", "contract", "base_model", "framework_state", "trainable",
                                     "optimizer", OUTCOME)},
    }


def validate_root(doc: Any, where: Path) -> dict[str, Any]:
    """The root's own fields, read through its declaration (:class:`ApiRoot`; :func:`of` checks the parts)."""
    check_schema(doc, where)
    decode_manifest(doc, ApiRoot, where)
    return doc
