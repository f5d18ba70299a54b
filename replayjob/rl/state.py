"""Resume states and checkpoints: adapter, optimizer state, RNG states and the step counter.

Layout of a state directory::

    trainer_state.json          {"schema": ..., "step": S, "model": {...}, "files": {name: sha256}}
    adapter_model.safetensors   adapter weights (peft naming)
    adapter_config.json
    optimizer.safetensors       AdamW moments and step per parameter (checkpoints only)
    rng.safetensors             Torch CPU and CUDA RNG states (checkpoints only)

``step`` is the last completed step; ``-1`` is an initialisation state (nothing trained yet), which holds no
RNG state and no optimizer state (an ``optimizer.safetensors`` of it, as a chosen step zero's state writes, holds
the empty state only).  Every file listed in ``files`` is verified by SHA-256 before it is used; nothing is
pickled.  The adapter and the optimizer state are read when the state is: every floating tensor finite, the
second moments non-negative and no per-parameter step count above ``step + 1`` (:func:`optimizer_state_reasons`).
"""

from __future__ import annotations

import copy
import math
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, get_args, get_origin

import msgspec

from replayjob import tensorfile
from replayjob.declaration import FLOAT_MAX, INT64_MAX
from replayjob.digest import normalize_digest, sha256_bytes, sha256_file
from replayjob.errors import ContractError, IntegrityError, RefusedError
from replayjob.fsio import atomic_write_bytes
from replayjob.jsonio import pretty_bytes, read_json_object

if TYPE_CHECKING:
    import torch

STATE_SCHEMA = "replayjob.trainer_state/v1"
STATE_FILE = "trainer_state.json"
STATE_KEYS = ("schema", "step", "model", "files")  # every key of trainer_state.json (write_state)
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the adapter weights of a state, a capture and a final adapter
FINAL_ADAPTER_DIR = "final_adapter"  # where a source run, a capture and a replay write the adapter after the update
FINAL_ADAPTER_FILE = f"{FINAL_ADAPTER_DIR}/{ADAPTER_WEIGHTS}"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"


@dataclass(frozen=True)
class ResumeState:
    path: Path
    step: int
    model: dict[str, Any]
    adapter_file: Path
    adapter_sha256: str
    files: dict[str, str]
    #: each adapter tensor's dtype (``torch.float32``) and shape, as read from the pinned file
    adapter_layout: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)

    @property
    def has_optimizer(self) -> bool:
        return OPTIMIZER_FILE in self.files

    @property
    def has_rng(self) -> bool:
        return RNG_FILE in self.files


def read_state(path: str | Path) -> ResumeState:
    """Read and verify a resume state directory, or refuse naming what is wrong."""
    d = Path(path)
    if not d.is_dir():
        raise RefusedError("resume state is not a directory", where=d,
                           hint="run `replayjob init DIR` and point resume.from at DIR/init_resume")
    doc = read_json_object(d / STATE_FILE)
    if doc.get("schema") != STATE_SCHEMA:
        raise IntegrityError(f"unknown trainer state schema {doc.get('schema')!r}", where=d / STATE_FILE)
    unknown = sorted(set(doc) - set(STATE_KEYS))
    if unknown:  # write_state writes these keys only: another is an edit, never silently ignored
        raise IntegrityError(f"unknown key(s) {[k[:40] for k in unknown[:5]]} ({STATE_SCHEMA} has "
                             + ", ".join(STATE_KEYS) + ")", where=d / STATE_FILE,
                             hint="the state was modified after it was written; recreate it")
    step = doc.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < -1:
        raise IntegrityError(f"'step' must be an integer >= -1, found {step!r}", where=d / STATE_FILE)
    files = doc.get("files")
    model = doc.get("model")
    if not isinstance(files, dict) or ADAPTER_WEIGHTS not in files or not isinstance(model, dict):
        raise IntegrityError("'files' must list adapter_model.safetensors and 'model' must be an object",
                             where=d / STATE_FILE)
    tensors: dict[str, dict[str, torch.Tensor]] = {}  # the files whose values are checked, read once here
    for name, digest in sorted(files.items()):
        if "/" in name or "\\" in name or name.startswith(".") or not isinstance(digest, str):
            raise IntegrityError(f"bad file entry {name!r}", where=d / STATE_FILE)
        if not name.endswith(".safetensors"):
            raise IntegrityError(f"file entry {name!r} is not a .safetensors file; pickle is never loaded",
                                 where=d / STATE_FILE, hint="resume states hold safetensors files only")
        if normalize_digest(digest, what=f"the pin of {name}") != digest:
            raise IntegrityError(f"the pin of {name} is not a lowercase hex SHA-256", where=d / STATE_FILE)
        f = d / name
        if f.is_symlink() or not f.is_file():
            raise IntegrityError(f"{name} is missing or not a regular file", where=d)
        scanned = tensorfile.scan(f, keep=name in (ADAPTER_WEIGHTS, OPTIMIZER_FILE, RNG_FILE), follow_symlinks=False)
        if scanned.sha256 != digest:
            raise IntegrityError(f"{name} has SHA-256 {scanned.sha256}, trainer_state.json pins {digest}",
                                 where=d, hint="the state was modified after it was written; recreate it")
        scanned.validated()  # structure checked before anything loads it
        if name in (ADAPTER_WEIGHTS, OPTIMIZER_FILE, RNG_FILE):
            tensors[name] = scanned.tensors()
    _check_values(d, step, files, tensors)
    layout = {k: (str(t.dtype), tuple(t.shape)) for k, t in tensors[ADAPTER_WEIGHTS].items()}
    return ResumeState(d, step, model, d / ADAPTER_WEIGHTS, files[ADAPTER_WEIGHTS], dict(files), layout)


_STATE_HINT = "the state was modified after it was written, or no training could have produced it; recreate it"


def _check_values(d: Path, step: int, files: Mapping[str, str], tensors: Mapping[str, dict[str, torch.Tensor]]) -> None:
    """What a resume state's tensors hold, against its step: an initialisation state (step -1) carries no RNG
    state and no optimizer state; the adapter and the optimizer state are finite, the second moments are
    non-negative, and no per-parameter step count is above the ``step + 1`` optimizer steps the built-in trainer
    took up to the state (it steps once per step; a parameter without a gradient in a step is not stepped).
    Refused naming the file and tensor, before anything uses them."""
    if step == -1 and RNG_FILE in files:
        raise IntegrityError(f"trainer_state.json lists {RNG_FILE}, but an initialisation state (step -1) holds no "
                             "RNG state (a run from it seeds from its config)", where=d / STATE_FILE,
                             hint=f"remove {RNG_FILE} from files, or run `replayjob init` again")
    reasons = tensor_reasons(tensors[ADAPTER_WEIGHTS], "tensor")
    if reasons:
        raise IntegrityError(_listed(reasons), where=d / ADAPTER_WEIGHTS, hint=_STATE_HINT)
    if RNG_FILE in files:  # the states a resumed run restores: Torch's CPU one and any CUDA device's, each one the
        rng = tensors[RNG_FILE]  # generator would take (its device's visibility is checked when it is restored)
        reasons = [] if "cpu" in rng else [f"{RNG_FILE} holds no cpu state (it holds {sorted(rng)[:4]})"]
        reasons += [r for key in sorted(rng) if (r := rng_state_reason(key, rng[key])) is not None]
        if reasons:
            raise IntegrityError(_listed(reasons), where=d / RNG_FILE, hint=_STATE_HINT)
    if OPTIMIZER_FILE not in files:
        return
    opt = tensors[OPTIMIZER_FILE]
    if step == -1 and set(opt) != {EMPTY_STATE}:
        raise IntegrityError(f"an initialisation state (step -1) starts a fresh optimizer, but {OPTIMIZER_FILE} "
                             f"holds optimizer state ({', '.join(sorted(opt)[:3])}, ...)", where=d / OPTIMIZER_FILE,
                             hint=f"remove {OPTIMIZER_FILE} from the state, or resume from the state of the step "
                                  "it was saved at")
    reasons = adamw_layout_reasons(opt, tensors[ADAPTER_WEIGHTS])
    reasons += optimizer_state_reasons(opt, step + 1, f"a state of step {step} (after {step + 1} optimizer "
                                                      "step(s))")
    if reasons:
        raise IntegrityError(_listed(reasons), where=d / OPTIMIZER_FILE, hint=_STATE_HINT)


def _listed(reasons: list[str]) -> str:
    return "; ".join(reasons[:4]) + (f" (and {len(reasons) - 4} more)" if len(reasons) > 4 else "")


def write_state(d: Path, step: int, model_ref: dict[str, Any], extra_files: dict[str, bytes],
                adapter_sha256: str | None = None) -> dict[str, str]:
    """Write extra files, hash everything present, then ``trainer_state.json`` last; return the pinned
    digests.  ``adapter_sha256``: the digest of the adapter file's bytes when the caller already holds
    them (it wrote them), so the file is not read back."""
    files = {ADAPTER_WEIGHTS: adapter_sha256 or sha256_file(d / ADAPTER_WEIGHTS)}
    for name, data in extra_files.items():
        atomic_write_bytes(d / name, data)
        files[name] = sha256_bytes(data)  # the bytes just written, not read back
    files = dict(sorted(files.items()))
    doc = {"schema": STATE_SCHEMA, "step": step, "model": model_ref, "files": files}
    atomic_write_bytes(d / STATE_FILE, pretty_bytes(doc))
    return files


def check_model(state: ResumeState, model_ref: dict[str, Any]) -> None:
    if state.model != model_ref:
        raise ContractError(f"resume state was made for model {state.model}, this config builds {model_ref}",
                            where=state.path / STATE_FILE, hint="use the [model] section the state was made with")


def safetensors_bytes(tensors: Mapping[str, torch.Tensor], fmt: str) -> bytes:
    """The one safetensors serialisation every state file uses: CPU, contiguous, keys sorted, ``fmt`` as
    the file's ``format`` metadata."""
    return tensorfile.encode({k: tensors[k].detach().to("cpu").contiguous() for k in sorted(tensors)},
                             metadata={"format": fmt}).data


def adapter_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The adapter weight file's bytes (``adapter_model.safetensors``, a captured adapter, a final adapter):
    one serialisation for every producer and writer, so equal tensors under equal names have equal SHA-256."""
    return safetensors_bytes(tensors, "pt")


# -- optimizer state: one serialisation for every producer ---------------------------------------------
#
# ``optimizer.safetensors`` holds the optimizer's per-parameter tensor state as ``state.<i>.<key>`` (``i`` the
# parameter's index in ``state_dict()`` order, across groups), or the one tensor ``state.none`` when the
# optimizer holds no state yet.  What is not a tensor (param_groups, non-tensor per-parameter values) is
# described in JSON by :func:`split_optimizer_state`; a capture records that description in its manifest.

EMPTY_STATE = "state.none"
_LEGACY_KEY = re.compile(r"^(\d+)\.(\w+)\Z")  # "<i>.<key>": checkpoints written before the shared names


def json_value(v: Any, where: str) -> Any:
    """``v`` as JSON (finite numbers, strings, lists, string-keyed objects), or refuse naming ``where``."""
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise RefusedError(f"{where} is a non-finite number", where=where,
                               hint="only finite inputs can be captured")
        return v
    if isinstance(v, list | tuple):
        return [json_value(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, Mapping) and all(isinstance(k, str) for k in v):
        return {k: json_value(x, f"{where}.{k}") for k, x in v.items()}
    raise RefusedError(f"{where} is a {type(v).__name__}, which is neither a tensor nor a JSON value",
                       where=where, hint="pass tensors, numbers, strings, lists or None to record()")


def split_optimizer_state(sd: Mapping[str, Any], *, copy: bool = True
                          ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer ``state_dict`` as tensors (``state.<i>.<key>``: CPU copies, or with ``copy`` false the CPU
    tensors themselves, for a caller that copies them at once) and a JSON description of the rest:
    ``param_groups``, non-tensor per-parameter ``state`` and, per parameter, its ``tensors`` keys."""
    import torch
    tensors: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    keys: dict[str, list[str]] = {}
    for idx, entry in sd["state"].items():
        for key, v in entry.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{idx}.{key}"] = v.detach().to("cpu", copy=copy).contiguous()
                keys.setdefault(str(idx), []).append(key)
            else:
                state.setdefault(str(idx), {})[key] = json_value(v, f"optimizer state {idx}.{key}")
    groups = [json_value(g, f"optimizer param_groups[{i}]") for i, g in enumerate(sd["param_groups"])]
    return tensors, {"param_groups": groups, "state": state, "tensors": {k: sorted(v) for k, v in keys.items()}}


def join_optimizer_state(tensors: Mapping[str, torch.Tensor], doc: Mapping[str, Any],
                         params: list[torch.nn.Parameter], where: str | Path) -> dict[str, Any]:
    """Rebuild an optimizer ``state_dict`` from :func:`split_optimizer_state`'s parts, checking every
    tensor's shape against its parameter (a state that does not fit the adapter is refused).  Every tensor
    is a fresh copy on its parameter's device: the optimizer keeps the tensors it is given and updates them
    in place, so none may be a view of a file's buffer or of a state that is restored again."""
    import torch
    expected = {f"state.{i}.{k}" for i, ks in doc["tensors"].items() for k in ks} or {EMPTY_STATE}
    if set(tensors) != expected:
        raise ContractError(f"optimizer file tensors {sorted(set(tensors) ^ expected)[:5]} do not match the "
                            "optimizer description", where=where)
    state: dict[int, dict[str, Any]] = {}
    for idx in sorted({*doc["tensors"], *doc["state"]}, key=int):
        i = int(idx)
        if not 0 <= i < len(params):
            raise ContractError(f"optimizer state for parameter {i}, but the adapter has {len(params)}", where=where)
        entry: dict[str, Any] = dict(doc["state"].get(idx, {}))
        for key in doc["tensors"].get(idx, []):
            t = tensors[f"state.{idx}.{key}"]
            if t.dim() > 0 and tuple(t.shape) != tuple(params[i].shape):
                raise ContractError(f"optimizer state {idx}.{key} has shape {tuple(t.shape)}, its parameter "
                                    f"{tuple(params[i].shape)}", where=where)
            fresh = torch.empty(t.shape, dtype=t.dtype, device=params[i].device if t.dim() > 0 else t.device)
            entry[key] = fresh.copy_(t)
        state[i] = entry
    groups = copy.deepcopy(doc["param_groups"])
    for g in groups:
        if "betas" in g and isinstance(g["betas"], list):
            g["betas"] = tuple(g["betas"])
    return {"state": state, "param_groups": groups}


# -- what a start state may hold: one set of rules for the built-in resume states and the capture API's files -----
#
# An optimizer state is the state after some number of optimizer steps: every per-parameter ``step`` count is that
# number, every moment finite and every second moment non-negative.  The built-in trainer steps once per step (a
# state of step S follows S + 1 steps, :func:`read_state`); the capture API's step K follows K optimizer steps, or
# the LR scheduler's ``last_epoch`` where a loss scaler skipped steps (the optimizer's and the scheduler's both;
# ``last_epoch`` is at most K: :class:`replayjob.artifacts.api_manifest.ApiManifest`).  The capture API also
# records the optimizer's param groups and the scheduler's state as JSON (:func:`optimizer_description_reasons`,
# :func:`scheduler_reasons`).  Each function returns the reasons, empty when there are none.

SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")  # AdamW's (and Adam's amsgrad) running squares: never negative
_STATE_KEY = re.compile(r"state\.(0|[1-9][0-9]*)\.(.+)\Z", re.ASCII | re.DOTALL)
_INDEX = re.compile(r"0|[1-9][0-9]*", re.ASCII)


def _state_key(name: str) -> tuple[str, str] | None:
    """``(index, key)`` of an optimizer file's tensor (``state.<i>.<key>``, or ``<i>.<key>`` as checkpoints written
    before the shared names have it); None for the empty state or another name."""
    found = _LEGACY_KEY.match(name) or _STATE_KEY.match(name)
    return (found.group(1), found.group(2)) if found else None


def _index(idx: str) -> int | None:
    """A parameter index as a state's keys spell it (decimal, no sign or leading zero), or None."""
    return int(idx) if _INDEX.fullmatch(idx) else None


def tensor_reasons(tensors: Mapping[str, torch.Tensor], what: str) -> list[str]:
    """Each floating tensor of ``tensors`` holding a NaN or an infinity, named (``what``: how a reason names one)."""
    import torch
    reasons = []
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                reasons.append(f"{what} {name} holds {bad} NaN or infinite value(s)")
    return reasons


def optimizer_state_reasons(tensors: Mapping[str, torch.Tensor], most: int, after: str,
                            state: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
    """Why an optimizer file's tensors (``state.<i>.<key>``, with ``state``, its non-tensor per-parameter values)
    cannot be the optimizer state ``after`` describes: a non-finite tensor, a negative second moment, or a
    per-parameter ``step`` count that is not a whole number from 0 to ``most``, the optimizer steps taken before
    it (fewer are possible: an optimizer does not step a parameter that got no gradient, such as an expert's
    adapter no token was routed to, and a trainer may skip a step on a non-finite gradient norm)."""
    import torch
    reasons = tensor_reasons(tensors, "tensor")

    def count(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= most \
                or value != int(value):
            reasons.append(f"{name} counts {str(value)[:24]} optimizer step(s), but it is {after}: no "
                           f"parameter has been stepped more than {most} time(s)")

    for name in sorted(tensors):
        parsed, t = _state_key(name), tensors[name]
        if parsed is None:
            continue
        if parsed[1] in SECOND_MOMENTS and t.is_floating_point() and bool((t < 0).any()):
            reasons.append(f"tensor {name} holds {int((t < 0).sum())} negative value(s); a second moment is a "
                           "running mean of squares")
        if parsed[1] == "step":
            if t.numel() != 1:
                reasons.append(f"tensor {name} has shape {list(t.shape)}, not one step count")
            elif bool(torch.isfinite(t).all()):
                count(f"tensor {name}", t.reshape(()).item())
    for idx, entry in sorted((state or {}).items()):
        if isinstance(entry, Mapping) and "step" in entry:
            count(f"optimizer.state.{idx}.step", entry["step"])
    return reasons


ADAMW_KEYS = ("exp_avg", "exp_avg_sq", "step")  # what torch.optim.AdamW (amsgrad off) holds per stepped parameter


def adamw_layout_reasons(opt: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor]) -> list[str]:
    """Why a built-in resume state's optimizer file (the trainer's AdamW over the adapter's parameters,
    :func:`optimizer_tensors`) cannot be loaded over the adapter beside it: a tensor that is neither the empty
    state alone nor ``state.<i>.<key>`` (or ``<i>.<key>``, once each) with ``key`` one of :data:`ADAMW_KEYS`, a
    parameter index beyond the adapter's tensors, a parameter holding some of AdamW's tensors but not all, a step
    count that is not a floating scalar, or moments of another dtype than the adapter's or of a shape no adapter
    tensor has (more parameters of one shape than the adapter holds).  Which index is which parameter only the
    built model tells (the replay compares each shape with its parameter's); every other rule holds here, before
    the optimizer casts a moment to its parameter's dtype or fails in its first step on a missing one."""
    reasons: list[str] = []
    if EMPTY_STATE in opt:
        if len(opt) > 1:
            reasons.append(f"tensor {EMPTY_STATE} (an optimizer without state) stands beside per-parameter state "
                           f"({', '.join(sorted(set(opt) - {EMPTY_STATE})[:3])})")
        return reasons
    entries: dict[int, dict[str, torch.Tensor]] = {}
    for name in sorted(opt):
        parsed = _state_key(name)
        at = _index(parsed[0]) if parsed is not None else None
        if parsed is None or at is None or parsed[1] not in ADAMW_KEYS:
            reasons.append(f"tensor {name[:60]!r} is not AdamW state (state.<i>.<key>, key one of "
                           f"{', '.join(ADAMW_KEYS)})")
        elif at >= len(adapter):
            reasons.append(f"tensor {name} is the state of parameter {at}, but the adapter has {len(adapter)} "
                           "parameter(s)")
        elif parsed[1] in entries.setdefault(at, {}):
            reasons.append(f"parameter {at}'s {parsed[1]} is in the file twice (state.{at}.{parsed[1]} and "
                           f"{at}.{parsed[1]})")
        else:
            entries[at][parsed[1]] = opt[name]
    dtypes = sorted({str(t.dtype) for t in adapter.values()})
    available = Counter(tuple(t.shape) for t in adapter.values())
    for at, entry in sorted(entries.items()):
        missing = [k for k in ADAMW_KEYS if k not in entry]
        if missing:
            reasons.append(f"parameter {at} holds AdamW state without {', '.join(missing)} (AdamW creates "
                           f"{', '.join(ADAMW_KEYS)} together)")
            continue
        if entry["step"].dim() != 0 or not entry["step"].is_floating_point():
            reasons.append(f"tensor state.{at}.step is {entry['step'].dtype}{list(entry['step'].shape)}, not "
                           "AdamW's floating scalar step count")
        avg, sq = entry["exp_avg"], entry["exp_avg_sq"]
        for key, t in (("exp_avg", avg), ("exp_avg_sq", sq)):
            if str(t.dtype) not in dtypes:
                reasons.append(f"tensor state.{at}.{key} is {t.dtype}, the adapter's parameters are "
                               f"{', '.join(dtypes)}")
        if avg.shape != sq.shape:
            reasons.append(f"tensors state.{at}.exp_avg {list(avg.shape)} and state.{at}.exp_avg_sq "
                           f"{list(sq.shape)} differ in shape (both are the shape of their parameter)")
        elif available[tuple(avg.shape)] <= 0:
            reasons.append(f"tensor state.{at}.exp_avg has shape {list(avg.shape)}, which no adapter parameter "
                           "left has")
        else:
            available[tuple(avg.shape)] -= 1
    return reasons


MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")  # torch's zeros_like(param) buffers


def optimizer_description_reasons(doc: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None,
                                  shapes: list[tuple[int, ...]] | None, params: int) -> list[str]:
    """Why the JSON half of an optimizer state (:func:`split_optimizer_state`'s ``doc``, as a capture records it)
    cannot be loaded with its tensors (the optimizer file's; None: unread) into an optimizer over the ``params``
    trainable parameters, and perhaps frozen ones too (an engine such as verl builds its optimizer over every
    parameter; only those with a gradient ever get state): param groups that do not hold each index ``0 .. n-1``
    exactly once for n no fewer than ``params``, a per-parameter entry for no parameter, more parameters with
    state than are trainable, tensors other than ``doc["tensors"]`` lists, or, when the optimizer holds the
    trainable parameters only, a tensor whose shape is not its parameter's (``shapes``, in optimizer order; None:
    unknown).  The replay (:func:`join_optimizer_state`, the optimizer's ``load_state_dict``) would refuse or fail
    on each."""
    reasons: list[str] = []
    held: list[Any] = []
    for i, g in enumerate(doc["param_groups"]):
        got = g.get("params") if isinstance(g, Mapping) else None
        if not isinstance(got, list) or any(isinstance(p, bool) or not isinstance(p, int) for p in got):
            reasons.append(f"optimizer.param_groups[{i}].params must be a list of parameter indices")
            continue
        held += got
    n = len(held)
    if not reasons and (sorted(held) != list(range(n)) or n < params):
        reasons.append(f"optimizer.param_groups hold the parameter indices {sorted(held)[:8]}: each index 0..n-1 "
                       f"must be in exactly one group, for n at least the {params} trainable parameter(s)")
    for section in ("state", "tensors"):
        for idx in sorted(doc[section]):
            at = _index(idx)
            if at is None or at >= n:
                reasons.append(f"optimizer.{section} has an entry for parameter {idx[:20]!r}, but the param "
                               f"groups hold {n} parameter(s)")
    stateful = {idx for section in ("state", "tensors") for idx in doc[section]}
    if len(stateful) > params:
        reasons.append(f"optimizer state is recorded for {len(stateful)} parameters, but only {params} are "
                       "trainable (a parameter without a gradient never gets state)")
    if n != params:  # frozen parameters held too: which index is which parameter only the built model tells
        shapes = None
    if tensors is None:
        return reasons
    expected = {f"state.{i}.{k}" for i, ks in doc["tensors"].items() for k in ks} or {EMPTY_STATE}
    if set(tensors) != expected:
        reasons.append(f"the optimizer file's tensors differ from optimizer.tensors at "
                       f"{sorted(set(tensors) ^ expected)[:5]}")
    for name in sorted(set(tensors) & expected):
        parsed, t = _state_key(name), tensors[name]
        at = int(parsed[0]) if parsed is not None else len(shapes or ())
        if shapes is not None and at < len(shapes) and t.dim() > 0 and tuple(t.shape) != shapes[at]:
            reasons.append(f"tensor {name} has shape {list(t.shape)}, its parameter {list(shapes[at])}")
    return reasons


def moment_reasons(tensors: Mapping[str, torch.Tensor], dtypes: list[torch.dtype] | None) -> list[str]:
    """Why an optimizer file's moments (:data:`MOMENTS`, ``state.<i>.<key>``) are not the buffers an optimizer
    keeps: one that is not floating point, or, with ``dtypes`` (each parameter's, in optimizer order, where the
    optimizer holds the trainable parameters alone), one of another dtype than its parameter's (the optimizer's
    load_state_dict would cast it)."""
    reasons = []
    for name in sorted(tensors):
        parsed, t = _state_key(name), tensors[name]
        if parsed is None or parsed[1] not in MOMENTS:
            continue
        at = _index(parsed[0])
        if not t.is_floating_point():
            reasons.append(f"tensor {name} is {t.dtype}, not a floating-point moment")
        elif dtypes is not None and at is not None and at < len(dtypes) and t.dtype != dtypes[at]:
            reasons.append(f"tensor {name} is {t.dtype}, its parameter {dtypes[at]} (the optimizer would cast it "
                           "on loading)")
    return reasons


def scheduler_reasons(groups: list[Any], scheduler: Mapping[str, Any] | None, step: int) -> list[str]:
    """Why a captured LR scheduler state contradicts the optimizer's param groups or the step: each group's ``lr``
    is the scheduler's last learning rate for it (``_last_lr``: the scheduler sets both), and the scheduler has been
    stepped at most once at construction and once per optimizer step before step ``step`` (``_step_count``).  The
    rule on ``last_epoch`` is the manifest's (:class:`replayjob.artifacts.api_manifest.ApiManifest`)."""
    if not isinstance(scheduler, Mapping):
        return []
    reasons = []
    last = scheduler.get("_last_lr")
    if last is not None:
        if not isinstance(last, list) or len(last) != len(groups):
            reasons.append(f"optimizer.scheduler._last_lr must list one learning rate per param group "
                           f"({len(groups)}), found {str(last)[:40]}")
        else:
            for i, (g, lr) in enumerate(zip(groups, last, strict=True)):
                have = g.get("lr") if isinstance(g, Mapping) else None
                if have != lr or isinstance(have, bool) or isinstance(lr, bool):
                    reasons.append(f"optimizer.param_groups[{i}].lr is {str(have)[:24]}, but the LR scheduler set "
                                   f"it to {str(lr)[:24]} (optimizer.scheduler._last_lr[{i}])")
    count = scheduler.get("_step_count")
    if isinstance(count, int) and not isinstance(count, bool) and count > step + 1:
        reasons.append(f"optimizer.scheduler._step_count is {count}, but a scheduler stepped once when built and "
                       f"once per optimizer step has stepped at most {step + 1} time(s) before step {step}")
    return reasons + scheduler_type_reasons(groups, scheduler)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# -- what torch's optimizers and LR schedulers hold, declared: a param group's and a scheduler state's fields -------
#
# Each is a ``msgspec.Struct`` whose fields declare the type and range torch's constructors take (``Meta``: bounds,
# and in ``description`` the rule a refusal states); :func:`declared_reasons` is the one reader, checking every
# declared field a document holds (each reason collected, none masking another) and the required ones present.  A
# value an optimizer would refuse at construction (a negative learning rate or epsilon, a beta outside [0, 1)) or one
# its step cannot use (a string, a missing lr) is no state an optimizer held; load_state_dict takes a group's values
# as they are, so the replay would otherwise fail in its optimizer step (exit 3) or update with numbers no optimizer
# ran with.  What ties fields or documents together (the groups' keys, amsgrad's buffers, one value per group, the
# scheduler's learning rates) is stated beside the reader's call.

PER_GROUP = "per_group"  # a Meta extra: the field lists one value per param group
_NonNegative = Annotated[float, msgspec.Meta(ge=0.0, le=FLOAT_MAX, description="not a finite number >= 0")]
_Flag = Annotated[bool, msgspec.Meta(description="not true or false")]
_OptionalFlag = Annotated[bool | None, msgspec.Meta(description="not true, false or null")]
_Beta = Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)]


class ParamGroup(msgspec.Struct, frozen=True, kw_only=True):
    """One param group of a torch optimizer's ``state_dict`` (other keys, an optimizer's own, are left to it)."""

    MISSING: ClassVar[str] = "every torch optimizer's param group holds one"

    lr: _NonNegative
    initial_lr: _NonNegative = 0.0
    weight_decay: _NonNegative = 0.0
    momentum: _NonNegative = 0.0
    eps: Annotated[_NonNegative | list[_NonNegative | None],  # Adafactor: (eps1, eps2), eps1 perhaps null
                   msgspec.Meta(description="not a finite number >= 0 (or a list of them)")] = 0.0
    betas: Annotated[tuple[_Beta, _Beta], msgspec.Meta(description="not two numbers in [0, 1)")] = (0.0, 0.0)
    amsgrad: _Flag = False
    maximize: _Flag = False
    capturable: _Flag = False
    differentiable: _Flag = False
    nesterov: _Flag = False
    decoupled_weight_decay: _Flag = False
    centered: _Flag = False
    foreach: _OptionalFlag = None
    fused: _OptionalFlag = None


class SchedulerState(msgspec.Struct, frozen=True, kw_only=True):
    """A torch LR scheduler's ``state_dict`` (other keys, a scheduler's own, are left to it): its counters, one base
    learning rate and one ``lr_lambda`` state per param group, its flags; and no key naming its optimizer or a method
    (``RESERVED``: load_state_dict sets every key as an attribute of the scheduler, so one would replace it)."""

    MISSING: ClassVar[str] = "every torch LR scheduler's state holds one"
    RESERVED: ClassVar[tuple[str, ...]] = ("optimizer", "step", "get_lr", "get_last_lr", "state_dict",
                                           "load_state_dict", "print_lr", "_initial_step", "_get_closed_form_lr")

    last_epoch: Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX, description="not an integer >= -1")] = 0
    step_count: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX, description="not an integer >= 0")] = \
        msgspec.field(default=0, name="_step_count")
    base_lrs: Annotated[list[_NonNegative] | None, msgspec.Meta(
        description="must list one finite learning rate >= 0 per param group ({groups}), found {value}",
        extra={PER_GROUP: True})] = None
    lr_lambdas: Annotated[list[dict[str, Any] | None] | None, msgspec.Meta(
        description="must hold one null or object per param group ({groups}), found {value}",
        extra={PER_GROUP: True})] = None
    get_lr_called_within_step: _Flag = msgspec.field(default=False, name="_get_lr_called_within_step")
    is_initial: _Flag = msgspec.field(default=False, name="_is_initial")
    verbose: _Flag = False


def _meta(tp: Any) -> msgspec.Meta:
    """The ``Meta`` a declared field's rule is in (the outermost ``Annotated``'s)."""
    return next((m for m in get_args(tp)[1:] if isinstance(m, msgspec.Meta)), msgspec.Meta()) \
        if get_origin(tp) is Annotated else msgspec.Meta()


def declared_reasons(doc: Mapping[str, Any], kind: type[msgspec.Struct], at: str, groups: int | None = None
                     ) -> list[str]:
    """The one reader of :class:`ParamGroup` and :class:`SchedulerState`: why ``doc`` (``at`` names it) is not what
    ``kind`` declares -- a reserved key held, a required field missing, or a field's value not of its declared type
    and range (every field read on its own, so each reason is listed); ``groups``: how many values a per-group
    field lists (None: not checked)."""
    reasons = [f"{at}.{key} names the scheduler's {'optimizer' if key == 'optimizer' else 'method'}, which no "
               "scheduler state holds (loading it would replace it)"
               for key in sorted(set(doc) & set(getattr(kind, "RESERVED", ())))]
    for f in msgspec.structs.fields(kind):
        name = f.encode_name
        if name not in doc:
            if f.required:
                reasons.append(f"{at} has no {name}; {getattr(kind, 'MISSING', 'it is required')}")
            continue
        value, meta = doc[name], _meta(f.type)
        rule = meta.description or "not of its declared type"
        try:
            msgspec.convert(value, f.type, strict=True)
            ok = not (groups is not None and (meta.extra or {}).get(PER_GROUP) and value is not None
                      and len(value) != groups)
        except msgspec.ValidationError:
            ok = False
        if not ok:
            reasons.append(f"{at}.{name} " + (rule.format(groups=groups, value=str(value)[:40]) if "{" in rule
                                               else f"is {str(value)[:24]}, {rule}"))
    return reasons


def param_group_reasons(doc: Mapping[str, Any]) -> list[str]:
    """Why the param groups of a captured optimizer description (:func:`split_optimizer_state`'s ``doc``) are not
    ones a torch optimizer held: each group read through its declaration (:class:`ParamGroup`: an ``lr``; ``lr``,
    ``initial_lr``, ``weight_decay`` and ``momentum`` finite numbers >= 0; ``eps`` one, or a list of them (or null,
    as Adafactor's); ``betas`` two numbers in [0, 1); flags booleans, ``foreach`` and ``fused`` also null); every
    group holding the same keys; and under ``amsgrad`` every parameter of the group with state holding its
    ``max_exp_avg_sq`` (the step reads it)."""
    reasons: list[str] = []
    groups = [g for g in doc["param_groups"] if isinstance(g, Mapping)]
    keys = {frozenset(g) for g in groups}
    if len(keys) > 1:
        first, other = sorted(keys, key=sorted)[:2]
        reasons.append(f"optimizer.param_groups hold different keys ({sorted(first ^ other)[:4]} in some groups "
                       "only); an optimizer fills every group with the same settings")
    for i, g in enumerate(groups):
        at = f"optimizer.param_groups[{i}]"
        reasons += declared_reasons(g, ParamGroup, at)
        params = g.get("params")
        if g.get("amsgrad") is True and isinstance(params, list):
            for idx in params:
                held = doc["tensors"].get(str(idx))
                if held and "max_exp_avg_sq" not in held:
                    reasons.append(f"{at}.amsgrad is true, but parameter {idx}'s state holds no max_exp_avg_sq "
                                   "(an amsgrad step keeps one for every parameter it has stepped)")
    return reasons


def scheduler_type_reasons(groups: list[Any], scheduler: Mapping[str, Any],
                           at: str = "optimizer.scheduler") -> list[str]:
    """The captured LR scheduler's state read through its declaration (:class:`SchedulerState`: ``last_epoch`` an
    integer >= -1, ``_step_count`` one >= 0, ``base_lrs`` one finite number >= 0 per param group, ``lr_lambdas`` one
    null or object per group, its flags booleans, no key naming its optimizer or a method), and each group's
    ``initial_lr`` its ``base_lrs`` entry (the scheduler set it from it); ``at`` names it."""
    reasons = declared_reasons(scheduler, SchedulerState, at, len(groups))
    base = scheduler.get("base_lrs")
    if isinstance(base, list) and len(base) == len(groups) and all(_number(b) and b >= 0 for b in base):
        for i, (g, lr) in enumerate(zip(groups, base, strict=True)):
            have = g.get("initial_lr", lr) if isinstance(g, Mapping) else lr
            if have != lr or isinstance(have, bool):
                reasons.append(f"optimizer.param_groups[{i}].initial_lr is {str(have)[:24]}, but the LR scheduler "
                               f"started it from {str(lr)[:24]} ({at}.base_lrs[{i}])")
    return reasons


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The built-in trainer's optimizer state as :func:`split_optimizer_state`'s tensors, not copied (the
    snapshot packs them at once; its param_groups come from the config; a non-tensor per-parameter value
    is refused, since no description is kept)."""
    tensors, doc = split_optimizer_state(opt.state_dict(), copy=False)
    if doc["state"]:
        raise ContractError(f"the optimizer holds non-tensor state {sorted(doc['state'])[:3]}, which a "
                            "resume state does not record", hint="use torch.optim.AdamW")
    return tensors


def optimizer_bytes_of(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """``optimizer.safetensors`` bytes of :func:`split_optimizer_state`'s tensors (every producer's)."""
    import torch
    return safetensors_bytes(tensors or {EMPTY_STATE: torch.zeros(0)}, "replayjob-optimizer")


def optimizer_bytes(opt: torch.optim.Optimizer) -> bytes:
    return optimizer_bytes_of(optimizer_tensors(opt))


def load_optimizer(opt: torch.optim.Optimizer, path: Path, expected_sha256: str) -> None:
    """Load a built-in resume state's optimizer file into ``opt`` (its param_groups kept); the bytes loaded
    are the bytes checked against the pin.  Files written before the shared names (``<i>.<key>``) load too."""
    flat = tensorfile.load(path, expected_sha256=expected_sha256, follow_symlinks=False)
    tensors: dict[str, torch.Tensor] = {}
    keys: dict[str, list[str]] = {}
    for key, t in flat.items():
        legacy = _LEGACY_KEY.match(key)
        if legacy:
            key = f"state.{legacy.group(1)}.{legacy.group(2)}"
        tensors[key] = t
        if key != EMPTY_STATE:
            _, idx, name = key.split(".", 2)
            keys.setdefault(idx, []).append(name)
    sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    doc = {"tensors": keys, "state": {}, "param_groups": sd["param_groups"]}
    try:
        joined = join_optimizer_state(tensors, doc, params, path)
    except ContractError as exc:
        raise ContractError(f"optimizer state does not match the adapter parameters: {exc.message}",
                            where=path) from None
    opt.load_state_dict(joined)


def rng_tensors(prefix: str = "") -> dict[str, torch.Tensor]:
    """Torch CPU and per-device CUDA RNG states, keyed ``{prefix}cpu`` / ``{prefix}cuda.N``."""
    import torch
    out = {f"{prefix}cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            out[f"{prefix}cuda.{i}"] = torch.cuda.get_rng_state(i)
    return out


def rng_bytes() -> bytes:
    return safetensors_bytes(rng_tensors(), "replayjob-rng")


CUDA_RNG_BYTES = 16  # torch.cuda.get_rng_state(): the Philox seed and offset, 8 bytes each (little-endian)
_CUDA_KEY = re.compile(r"cuda\.(0|[1-9][0-9]*)", re.ASCII)


def rng_state_reason(key: str, t: torch.Tensor, name: str | None = None) -> str | None:
    """Why Torch would refuse ``t`` as the RNG state ``key`` (``cpu`` or ``cuda.N``), or None when it would not.

    Checked on the CPU, touching no device: the CPU state is loaded into a fresh ``torch.Generator()`` (the
    generator's own check, the process's generators untouched); a CUDA state's length (the 16 bytes every
    capture writes; Torch would also take a bare 8-byte seed, which no capture holds) and the rule the CUDA
    generator applies to its Philox offset (a multiple of 4).  Only a device can check the rest: that device
    ``N`` is visible (:func:`restore_rng` refuses it otherwise) and that its generator takes the state.
    ``name`` is how a refusal names the state (``rng.<key>`` by default)."""
    import torch
    name = name or f"rng.{key}"
    if t.dtype != torch.uint8 or t.dim() != 1:
        return f"{name} is {t.dtype}{list(t.shape)}, not a one-dimensional uint8 RNG state"
    if key == "cpu":
        want = torch.get_rng_state().numel()
        if t.numel() != want:
            return f"{name} has {t.numel()} bytes, this Torch's CPU generator state has {want}"
        try:
            torch.Generator().set_state(t.contiguous())
        except RuntimeError as exc:
            return f"{name} is not a state Torch's CPU generator accepts ({str(exc).splitlines()[0][:200]})"
        return None
    if not _CUDA_KEY.fullmatch(key):
        return f"{name} is not a Torch RNG state (expected cpu or cuda.N)"
    if t.numel() != CUDA_RNG_BYTES:
        return f"{name} has {t.numel()} bytes, a CUDA generator state has {CUDA_RNG_BYTES} (seed and offset)"
    offset = int.from_bytes(bytes(t[8:].tolist()), "little")
    if offset % 4:
        return f"{name} holds Philox offset {offset}, which the CUDA generator refuses (not a multiple of 4)"
    return None


def restore_rng(tensors: dict[str, torch.Tensor], prefix: str = "", where: str | Path | None = None) -> None:
    """Restore the CPU and CUDA RNG states in ``tensors`` (keys ``{prefix}cpu``, ``{prefix}cuda.N``).  A state
    the generator would refuse is the input's fault: refused naming it (:class:`IntegrityError`, exit 2), before
    any CUDA generator is touched where it can be told without one (:func:`rng_state_reason`)."""
    import torch

    def refuse(reason: str) -> IntegrityError:
        return IntegrityError(reason, where=where, hint="the captured RNG state is damaged; recapture the source step")

    def name(key: str) -> str:
        return f"{prefix}{key}" if prefix else f"rng.{key}"

    cuda = {key[len(prefix):]: t for key, t in tensors.items() if key.startswith(f"{prefix}cuda.")}
    for key, t in cuda.items():
        reason = rng_state_reason(key, t, name(key))
        if reason is not None:
            raise refuse(reason)
    cpu = tensors[f"{prefix}cpu"]
    try:
        torch.set_rng_state(cpu)
    except (RuntimeError, TypeError):  # the CPU generator's own check: only the state can be at fault
        raise refuse(rng_state_reason("cpu", cpu, name("cpu"))
                     or f"{name('cpu')} is not a state Torch's CPU generator accepts") from None
    for key, t in cuda.items():
        idx = int(key.rsplit(".", 1)[1])
        if idx >= torch.cuda.device_count():
            raise ContractError(f"{name(key)}: the capture holds the RNG state of CUDA device {idx}, but this "
                                f"process sees {torch.cuda.device_count()} CUDA device(s)", where=where,
                                hint="replay on a host with that device visible (CUDA_VISIBLE_DEVICES), as the "
                                     "source step ran")
        torch.cuda.set_rng_state(t, idx)  # a failure here is the device's (exit 3): the state passed every check


def load_rng(path: Path, expected_sha256: str) -> None:
    """Restore the RNG states in ``path``; the bytes loaded are the bytes checked against the pin."""
    restore_rng(tensorfile.load(path, expected_sha256=expected_sha256, follow_symlinks=False), where=path)
