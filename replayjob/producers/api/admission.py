"""Admission of a replay of an external trainer's capture, and its ``replayjob explain``: no model.

The replay config (the ``replay.toml`` a capture writes)::

    [integration]  framework = "trl"      (must equal the manifest's; selects the module that replays)
                   entry = "pkg.mod:fn"   (framework "torch" only: the user's replay target)
    [model]        path = "/base/model"   (hashed and compared with the capture's base model)
                   attn_implementation    (optional; a registered systems-only knob)
                   routing                (optional, "free" or "forced": an MoE model's routing, a knob of trl)
    [optimizer_batch]                     (the built-in section: replay_path, both pins, arm,
                                           allow_config_differences, tolerances_sha256)
    [<framework>]                         (optional overrides of the captured framework config)

This is the capture API's part of the one admission (:mod:`replayjob.producers.admission`, which runs the
pins and the manifest checks for every producer): each safetensors file against the manifest's size and
SHA-256 before deserialising, no symlink; the inputs' structure and the logical and
effective digests recomputed from the tensors; the base model's files by SHA-256 and a forced routing
file (``model.routing = "forced"``: :func:`replayjob.model.moe.file_reasons`); the optimizer
contract; and every difference between the captured config and the replay's (installed stack
versions included) declared, present, and a registered systems-only knob, or a stack difference,
which is admitted for the approximate claim only.  Nothing here imports a framework or builds a model.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob import tensorfile
from replayjob.artifacts import api_manifest as imanifest
from replayjob.artifacts.api_manifest import Manifest
from replayjob.artifacts.capture_manifest import PinnedManifest
from replayjob.artifacts.metrics import SKIPPED
from replayjob.config import redact
from replayjob.config.load import absolutize_paths, apply_overrides, build, read_toml
from replayjob.config.schema import OptimizerBatchConfig
from replayjob.declaration import check_summaries
from replayjob.digest import sha256_bytes, sha256_json
from replayjob.errors import ConfigError, IntegrityError, RefusedError
from replayjob.fsio import read_regular_bytes
from replayjob.jsonio import loads_strict
from replayjob.model import moe
from replayjob.producers import EXTERNAL, producer_module
from replayjob.producers import admission as shared
from replayjob.producers.admission import check_contract, check_differences
from replayjob.producers.api import files as _files
from replayjob.producers.api import microbatch as _microbatch
from replayjob.producers.api import precision
from replayjob.redact import redact_text
from replayjob.rl.state import (
    moment_reasons,
    optimizer_description_reasons,
    optimizer_state_reasons,
    param_group_reasons,
    rng_state_reason,
    scheduler_reasons,
    tensor_reasons,
)
from replayjob.runtime import knobs
from replayjob.runtime.distributed import launch_env

if TYPE_CHECKING:
    import torch

MODEL_KEYS = ("path", "attn_implementation", "routing")
ROUTINGS = ("free", "forced")
MAX_BASE_CONFIG_BYTES = 16 * 1024 * 1024  # a model's config.json is a few KiB


@dataclass(frozen=True)
class ReplayConfig:
    """A loaded integration replay config (TOML + ``--set``)."""

    path: Path
    framework: str
    entry: str
    model: dict[str, Any]
    overrides: dict[str, Any]
    optimizer_batch: OptimizerBatchConfig
    document: dict[str, Any]

    @property
    def sha256(self) -> str:
        return sha256_json(redact(self.document))


def load(path: str | Path, overrides: list[str]) -> ReplayConfig:
    """Read a replay config; unknown sections and keys are refused with their dotted path."""
    p = Path(path)
    data = apply_overrides(absolutize_paths(read_toml(p), p.resolve().parent), overrides)
    integ = data.get("integration")
    if not isinstance(integ, dict) or not isinstance(integ.get("framework"), str):
        raise ConfigError("[integration] needs framework = \"<name>\"", where="integration.framework",
                          hint="one of: " + ", ".join(sorted(EXTERNAL)))
    framework = integ["framework"]
    if framework not in EXTERNAL:
        raise ConfigError(f"unknown framework {framework!r}", where="integration.framework",
                          hint="one of: " + ", ".join(sorted(EXTERNAL)))
    extra = sorted(set(integ) - {"framework", "entry"})
    if extra or not isinstance(integ.get("entry", ""), str):
        raise ConfigError(f"unknown or mistyped keys {extra or ['entry']}", where="integration",
                          hint="[integration] takes framework and (framework 'torch') entry")
    unknown = sorted(set(data) - {"integration", "model", "optimizer_batch", framework})
    if unknown:
        raise ConfigError(f"unknown section {unknown[0]!r}", where=unknown[0],
                          hint=f"sections: integration, model, optimizer_batch, {framework}")
    model = data.get("model", {})
    if not isinstance(model, dict) or sorted(set(model) - set(MODEL_KEYS)):
        raise ConfigError("[model] takes only " + ", ".join(MODEL_KEYS), where="model")
    if "path" in model and not isinstance(model["path"], str):
        raise ConfigError(f"expected a string (the base model directory), found {type(model['path']).__name__}",
                          where="model.path", hint="the capture's replay.toml has it")
    if not model.get("path"):
        raise ConfigError("model.path is required: the base model directory", where="model.path",
                          hint="the capture's replay.toml has it")
    fw = data.get(framework, {})
    if not isinstance(fw, dict):
        raise ConfigError("must be a table of overrides", where=framework)
    for where, value in _numbers({"model": model, framework: fw}):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{value!r} is not a finite number", where=where,
                              hint="an override takes a finite value (the captured config holds no NaN or Inf)")
    ob = build(OptimizerBatchConfig, data.get("optimizer_batch", {}), "optimizer_batch")
    return ReplayConfig(p, framework, str(integ.get("entry", "")), dict(model), fw, ob, data)


def _numbers(value: Any, at: str = "") -> list[tuple[str, Any]]:
    """Every leaf of ``value`` (tables and arrays walked) with its dotted key."""
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _numbers(v, f"{at}.{k}" if at else str(k))]
    if isinstance(value, list):
        return [x for i, v in enumerate(value) for x in _numbers(v, f"{at}[{i}]")]
    return [(at, value)]


@dataclass
class Admission(shared.Admission):
    """What was verified for one integration replay, and every refusal reason."""

    cfg: ReplayConfig | None = None
    manifest: Manifest | None = None
    micro_batches: list[_microbatch.MicroBatch] | None = None
    adapter: dict[str, torch.Tensor] | None = None
    optimizer: dict[str, torch.Tensor] | None = None
    resolved: dict[str, Any] | None = None
    #: a capture over several processes: each process's micro-batches (``micro_batches`` holds them all, in rank
    #: order); None for a one-process capture
    rank_micro_batches: list[list[_microbatch.MicroBatch]] | None = None
    #: how many processes the replay runs on (the launcher's, or --nproc in the process that launches them)
    processes: int = 1
    #: the base model's ``config.json`` as hashed with it (:func:`_check_base_model`: read once, its bytes the
    #: captured ones); None where the base model was not admitted or the file is not a JSON object
    base_config: dict[str, Any] | None = None

    @property
    def captured_processes(self) -> int:
        return imanifest.processes(self.manifest)

    def optimizer_batch(self) -> OptimizerBatchConfig:
        assert self.cfg is not None
        return self.cfg.optimizer_batch

    @property
    def arm(self) -> str:
        assert self.cfg is not None
        return redact_text(self.cfg.optimizer_batch.arm) or knobs.arm_name(self.allowed, self.resolved or {})

    def knob_values(self) -> dict[str, Any]:
        out: dict[str, Any] = redact({k: knobs.lookup(self.resolved or {}, k) for k in sorted(self.allowed)})
        return out


def _load_file(adm: Admission, m: Manifest, role: str) -> dict[str, torch.Tensor] | None:
    """One capture file, its size and SHA-256 checked against the manifest before it is deserialised."""
    p = m.file(role)
    spec = m.doc["files"][role]
    what = {"payload": "payload", "adapter": "initial adapter", "optimizer": "optimizer state"}[role]
    try:
        if p.is_symlink() or not p.is_file():
            raise RefusedError(f"{what} file missing (or not a regular file)", where=p)
        if p.stat().st_size != spec["size"]:
            raise RefusedError(f"{what} file is {p.stat().st_size} bytes, the manifest pins {spec['size']} "
                               "(it changed after capture; nothing in it was used)", where=p)
        return tensorfile.load(p, expected_sha256=spec["sha256"], follow_symlinks=False)
    except RefusedError as exc:
        adm.refuse(f"{what}: " + exc.diagnostics().replace("\n  fix:", "; fix:"), integrity=True)
    except OSError as exc:
        adm.refuse(f"{p}: cannot read the {what}: {exc.strerror}", integrity=True)
    return None


def _group(tensors: dict[str, torch.Tensor], prefix: str, spec: dict[str, Any], where: str,
           adm: Admission) -> dict[str, torch.Tensor]:
    out = {}
    for name, want in spec["tensors"].items():
        t = tensors.pop(f"{prefix}{name}", None)
        if t is None:
            adm.refuse(f"{where}: tensor {prefix}{name} is missing from the payload", integrity=True)
            continue
        if _microbatch.dtype_name(t) != want["dtype"] or list(t.shape) != want["shape"]:
            adm.refuse(f"{where}: {prefix}{name} is {_microbatch.dtype_name(t)}{list(t.shape)}, the manifest says "
                       f"{want['dtype']}{want['shape']}", integrity=True)
        out[name] = t
    return out


def _check_payload_tensors(adm: Admission, m: Manifest, tensors: dict[str, torch.Tensor],
                   part: bool = False) -> list[_microbatch.MicroBatch] | None:
    """The payload against its manifest; the micro-batches (``part``: one process's of several, checked against
    its own manifest only; the caller checks the whole against the root and the pins)."""
    left = dict(tensors)
    mbs = []
    for i, e in enumerate(m.micro_batches):
        w = f"{m.file('payload')} micro-batch {i}"
        ins = _group(left, f"mb{i:04d}.inputs.", e["inputs"], w, adm)
        call = _group(left, f"mb{i:04d}.call.", e["call"], w, adm)
        rng = {k: left.pop(f"mb{i:04d}.rng.{k}") for k in e["rng"] if f"mb{i:04d}.rng.{k}" in left}
        if sorted(rng) != sorted(e["rng"]):
            adm.refuse(f"{w}: RNG states {sorted(rng)} differ from the manifest's {e['rng']}", integrity=True)
        for k in sorted(rng):  # a state the generator would refuse, found before a replay restores it
            reason = rng_state_reason(k, rng[k], f"mb{i:04d}.rng.{k}")
            if reason is not None:
                adm.refuse(f"{w}: {reason}", integrity=True)
        for group, held in (("inputs", ins), ("call", call)):  # each input's declared domain (INPUT_DOMAINS)
            for reason in imanifest.input_domain_reasons(m.framework, group, held):
                adm.refuse(f"{w}: {reason}; no real step holds it (the payload was edited after capture; recapture "
                           "the step)", integrity=True)
        mbs.append(_microbatch.MicroBatch(ins, dict(e["inputs"]["values"]), call, dict(e["call"]["values"]), rng,
                                  e["sync_gradients"], e["accumulation_steps"]))
    if left:
        adm.refuse(f"{m.file('payload')}: tensors the manifest does not describe: {sorted(left)[:5]}", integrity=True)
    if not adm.admitted:
        return None
    logical = _microbatch.logical_digest(mbs)
    if logical != m.logical_sha256:  # the logical pin was compared with the manifest's already (shared)
        adm.refuse(f"payload inputs hash to {logical}, the manifest says {m.logical_sha256}", integrity=True)
    effective = _microbatch.effective_digest(mbs)
    if effective != m.effective_sha256:
        adm.refuse(f"payload RNG and accumulation settings hash to {effective}, the manifest says "
                   f"{m.effective_sha256}", integrity=True)
    if part:
        return mbs
    _check_nonfinite(adm, m, mbs)
    adm.micro_batches = mbs
    return mbs


def _check_parts(adm: Admission, m: imanifest.RootManifest) -> None:
    """A capture over several processes: every part's payload against its manifest, then every micro-batch in
    rank order against the root's digests and the logical pin."""
    parts = []
    for part in m.parts:
        payload = _load_file(adm, part, "payload")
        mbs = _check_payload_tensors(adm, part, payload, part=True) if payload is not None else None
        if mbs is None:
            return
        parts.append(mbs)
    every = [mb for p in parts for mb in p]
    logical = _microbatch.logical_digest(every)
    if logical != m.logical_sha256:  # the logical pin was compared with the root's already (shared)
        adm.refuse(f"the processes' inputs in rank order hash to {logical}, the root says {m.logical_sha256}",
                   integrity=True)
    if _microbatch.effective_digest(every) != m.effective_sha256:
        adm.refuse("the processes' RNG and accumulation settings do not hash to the root's effective digest",
                   integrity=True)
    _check_nonfinite(adm, m, every)
    adm.micro_batches, adm.rank_micro_batches = every, parts


def _check_nonfinite(adm: Admission, m: Manifest, mbs: list[_microbatch.MicroBatch]) -> None:
    """Inputs holding NaN/Inf replay only when the manifest flags them and the config opts in."""
    assert adm.cfg is not None
    found, flagged = _microbatch.has_nonfinite(mbs), bool(m.doc["rows"].get("nonfinite_inputs", False))
    try:  # the manifest's (or the root's) rows block summarises the micro-batches: recomputed from them
        check_summaries({"nonfinite_inputs": False, **m.doc["rows"]},
                        {**_microbatch.rows_summary(mbs), "nonfinite_inputs": found}, where=m.path, what="rows")
    except IntegrityError as exc:
        adm.refuse(f"{m.path}: {exc.message}", integrity=True)
        return
    if found != flagged:
        adm.refuse(f"{m.file('payload')}: the inputs {'hold' if found else 'hold no'} non-finite values but the "
                   f"manifest's rows.nonfinite_inputs says {str(flagged).lower()}", integrity=True)
    elif found and not adm.cfg.optimizer_batch.allow_nonfinite_inputs:
        adm.refuse("the capture's inputs hold non-finite values (flagged rows.nonfinite_inputs); replay them only "
                   "with optimizer_batch.allow_nonfinite_inputs = true")


def _check_payload(adm: Admission) -> None:
    cfg, m = adm.cfg, adm.manifest
    assert cfg is not None and m is not None
    if m.framework != cfg.framework:
        adm.refuse(f"the capture was produced by {m.framework!r}, the config says integration.framework = "
                   f"{cfg.framework!r}")
        return
    if isinstance(m, imanifest.RootManifest):
        _check_parts(adm, m)  # the adapter and optimizer files every part shares are process 0's (read below)
    else:
        payload = _load_file(adm, m, "payload")
        if payload is not None:
            _check_payload_tensors(adm, m, payload)


def _check_state(adm: Admission) -> None:
    """The captured adapter and optimizer state, each file against its pin (process 0's for a root: every part
    holds these same bytes)."""
    cfg, m = adm.cfg, adm.manifest
    assert cfg is not None
    if m is None or m.framework != cfg.framework:
        return
    first = m.parts[0] if isinstance(m, imanifest.RootManifest) else m
    adm.adapter = _load_file(adm, first, "adapter")
    if adm.adapter is not None and sorted(adm.adapter) != sorted(m.doc["trainable"]):
        adm.refuse(f"{m.file('adapter')}: parameters differ from the manifest's trainable list", integrity=True)
        adm.adapter = None
    if adm.adapter is not None:
        for reason in tensor_reasons(adm.adapter, "parameter"):
            adm.refuse(f"{m.file('adapter')}: {reason}; an update starts from finite parameters (recapture the "
                       "step)", integrity=True)
    adm.optimizer = _load_file(adm, first, "optimizer")
    _check_optimizer(adm, m)
    _check_framework_state(adm, m)


def _check_optimizer(adm: Admission, m: Manifest) -> None:
    """The manifest's optimizer section and the optimizer file against each other, the adapter and the step (the
    rules :mod:`replayjob.rl.state` holds for every start state): param groups holding each trainable parameter once,
    the file's tensors those the section lists with their parameters' shapes, each group's learning rate the LR
    scheduler's, param group settings and scheduler state of the types and ranges torch's optimizers and
    schedulers hold (:func:`~replayjob.rl.state.param_group_reasons`), finite floating-point moments in their
    parameters' dtypes, non-negative second moments, and the per-parameter step counts of the optimizer steps before
    the captured one."""
    opt, trainable = m.doc["optimizer"], m.doc["trainable"]
    shapes = [tuple(adm.adapter[n].shape) for n in trainable] if adm.adapter is not None else None
    fix = "; the optimizer state contradicts itself or the step (recapture the step)"
    for reason in (optimizer_description_reasons(opt, adm.optimizer, shapes, len(trainable))
                   + param_group_reasons(opt) + scheduler_reasons(opt["param_groups"], opt["scheduler"], m.step)):
        adm.refuse(f"{m.path}: {reason}{fix}", integrity=True)
    if adm.optimizer is None:
        return
    after = f"the state before step {m.step}"
    # moments in their parameters' dtypes, where the optimizer holds the trainable parameters alone (in their order)
    held = sum(len(g["params"]) for g in opt["param_groups"] if isinstance(g.get("params"), list))
    dtypes = [adm.adapter[n].dtype for n in trainable] if adm.adapter is not None and held == len(trainable) else None
    for reason in (moment_reasons(adm.optimizer, dtypes)
                   + optimizer_state_reasons(adm.optimizer, m.step, after, opt["state"])):
        adm.refuse(f"{m.file('optimizer')}: {reason}{fix}", integrity=True)


def _check_framework_state(adm: Admission, m: Manifest) -> None:
    """What the producer's replay reads from ``framework_state`` (its ``framework_state_reasons``: TRL's
    ``max_steps``, verl's LR scheduler state and process count), typed and checked against the step and the processes
    the manifest says ran it, before any trainer is rebuilt."""
    own = getattr(producer_module(m.framework), "framework_state_reasons", None)
    if own is None:
        return
    for reason in own(m.doc["framework_state"], m.doc["optimizer"]["param_groups"], m.step, adm.captured_processes):
        adm.refuse(f"{m.path}: {reason}; the capture contradicts itself (recapture the step)", integrity=True)


def _check_base_model(adm: Admission) -> None:
    assert adm.cfg is not None
    if adm.manifest is None:
        return
    want = adm.manifest.doc["base_model"]
    try:
        have = _files.base_model_identity(adm.cfg.model["path"])
    except RefusedError as exc:
        adm.refuse(f"model.path: {exc.message}")
        return
    if have["sha256"] != want["sha256"]:
        diff = sorted(n for n in set(have["files"]) | set(want["files"])
                      if have["files"].get(n) != want["files"].get(n))
        adm.refuse(f"different base model: {have['path']} differs from the captured {want['path']} in "
                   + ", ".join(f"{n} ({(have['files'].get(n) or 'absent')[:12]} vs "
                               f"{(want['files'].get(n) or 'absent')[:12]})" for n in diff[:4]))
        return
    path = Path(str(adm.cfg.model["path"])) / "config.json"
    try:  # read once, as hashed: what the checks below read is the captured file, not a later one
        data = read_regular_bytes(path, max_bytes=MAX_BASE_CONFIG_BYTES, what="base model config.json")
    except RefusedError as exc:
        adm.refuse(f"model.path: {exc.message}")
        return
    if sha256_bytes(data) != want["files"].get("config.json"):
        adm.refuse(f"model.path: {path} changed while it was admitted (its SHA-256 is no longer the captured one); "
                   "leave the base model directory unchanged during a replay", integrity=True)
        return
    with contextlib.suppress(RefusedError):  # a config.json that is no JSON object holds no figure to check
        doc = loads_strict(data, where=path)
        adm.base_config = doc if isinstance(doc, dict) else None
    _check_vocabulary(adm)


def _check_vocabulary(adm: Admission) -> None:
    """Every captured token id (the inputs :data:`~replayjob.artifacts.api_manifest.INPUT_DOMAINS` declares token
    ids) within the vocabulary of the base model, where its ``config.json`` (hashed with the base model) says it:
    an id beyond it indexes no embedding row, so no real step holds it."""
    assert adm.cfg is not None and adm.manifest is not None
    names = [k for k, d in imanifest.INPUT_DOMAINS.get(adm.manifest.framework, {}).items() if d is imanifest.TOKEN_ID]
    if not names or adm.micro_batches is None:
        return
    import torch
    vocab = (adm.base_config or {}).get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        return
    for i, mb in enumerate(adm.micro_batches):
        for name in sorted(names):
            t = mb.inputs.get(name)
            if t is None or not t.numel() or t.is_floating_point() or t.dtype == torch.bool:
                continue
            top = int(t.max())
            if top >= vocab:
                adm.refuse(f"{adm.manifest.file('payload')} micro-batch {i}: inputs.{name} holds token id {top}, "
                           f"beyond the base model's vocabulary ({vocab} ids, config.json vocab_size); no real "
                           "step holds it (the payload was edited after capture; recapture the step)",
                           integrity=True)
                return


def sequence(framework: str, inputs: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The ``input_ids`` a captured micro-batch's model receives and its token mask: the framework module's
    ``sequence(inputs)`` where it has one (TRL: prompt and completion side by side), else the captured
    ``input_ids`` and ``attention_mask`` (all ones without one); ``None`` where the inputs hold neither."""
    import torch
    own = getattr(producer_module(framework), "sequence", None)
    if own is not None:
        got: tuple[torch.Tensor | None, torch.Tensor | None] = own(inputs)
        return got
    ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
    if ids is not None and mask is None:
        mask = torch.ones_like(ids)
    return ids, mask


def _check_routing(adm: Admission) -> None:
    """A forced routing file (``model.routing = "forced"``): present, pinned, recorded on this capture's logical batch,
    of the captured rows' real tokens and of the base model's routers (from its ``config.json``), before any model is
    built (:func:`replayjob.model.moe.file_reasons`, the check the built-in replay runs)."""
    cfg, m = adm.cfg, adm.manifest
    assert cfg is not None
    mode = cfg.model.get("routing", "free")
    shared.check_routing_settings(mode, cfg.optimizer_batch, adm)  # a routing file only forced routing reads
    if mode not in ROUTINGS:
        adm.refuse(f"model.routing is {mode!r}; it takes 'free' or 'forced'")
        return
    if mode == "free":
        return
    if knobs.MOE_ROUTING not in knobs.knobs_for(cfg.framework):
        return  # not a knob of this producer: the config comparison refuses the difference
    if adm.processes > 1 or adm.captured_processes > 1:
        adm.refuse("model.routing = 'forced' runs in one process on a one-process capture (over several processes no "
                   "process holds every row); replay it with routing free")
    per_row: list[int] | None = None
    if adm.micro_batches is not None:
        per_row = []
        for mb in adm.micro_batches:
            _, mask = sequence(cfg.framework, mb.inputs)
            if mask is None:
                per_row = None
                adm.refuse("model.routing = 'forced' needs the token mask of the sequence the model receives; the "
                           "captured inputs hold none")
                break
            per_row += [int(n) for n in (mask != 0).sum(dim=1).tolist()]
    # the base model's config.json as admitted (the base model check names what is wrong with the directory)
    shape = moe.config_routers(adm.base_config) if adm.base_config is not None else None
    logical = m.logical_sha256 if m is not None else None
    for reason in moe.file_reasons(cfg.optimizer_batch, logical, per_row, None, None, shape):
        adm.refuse(reason, integrity=True)


def _merge(base: dict[str, Any], over: dict[str, Any], where: str, adm: Admission) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if k not in base:
            adm.refuse(f"{where}.{k} is not a key of the captured config (overrides may only change "
                       "captured keys)")
        elif isinstance(v, dict) and isinstance(base[k], dict):
            out[k] = {**base[k], **v}
        elif base[k] is not None and (type(v) is not type(base[k]) and not (isinstance(v, int | float)
                                                                           and isinstance(base[k], float))):
            adm.refuse(f"{where}.{k} is {type(v).__name__}, the captured value is {type(base[k]).__name__}")
        else:
            out[k] = v
    return out


def _ignored(key: str) -> bool:
    return key == "model.path"  # a path; its content is pinned by the base model's file hashes instead


def _with_source_values(resolved: dict[str, Any], src: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """``resolved`` with each dotted key of ``keys`` that the source has set back to the source's value."""
    out = copy.deepcopy(resolved)
    for key in keys:
        *parents, leaf = key.split(".")
        node: Any = out
        have: Any = src
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            have = have.get(part) if isinstance(have, dict) else None
        if isinstance(node, dict) and isinstance(have, dict) and leaf in have:
            node[leaf] = copy.deepcopy(have[leaf])
    return out


def _check_config(adm: Admission) -> None:
    cfg, m = adm.cfg, adm.manifest
    assert cfg is not None
    adm.allowed = sorted(set(cfg.optimizer_batch.allow_config_differences))
    if m is None or m.framework != cfg.framework:
        return
    src = m.config
    fw = producer_module(cfg.framework)
    if adm.processes > 1 and not getattr(fw, "RANKS", False):
        adm.refuse(f"a {cfg.framework} replay runs in one process; {adm.processes} were launched")
    if adm.processes > 1 or adm.captured_processes > 1:  # the process count, compared as a config key
        src = {**src, "distributed": {"num_processes": adm.captured_processes}}
    if knobs.MOE_ROUTING in knobs.knobs_for(cfg.framework) and "routing" not in src.get("model", {}):
        src = {**src, "model": {**src.get("model", {}), "routing": "free"}}  # a trainer's own step routes freely
    resolved = dict(src)
    model_over = {k: v for k, v in cfg.model.items() if k != "path"}
    resolved["model"] = {**_merge(src.get("model", {}), model_over, "model", adm), "path": cfg.model["path"]}
    overrides = dict(cfg.overrides)
    canonical = getattr(fw, "canonical_names", None)  # one setting under two names: compared under one
    if canonical is not None:
        overrides, adm.allowed, why = canonical(src.get(cfg.framework, {}), overrides, adm.allowed)
        for reason in why:
            adm.refuse(reason)
    resolved[cfg.framework] = _merge(src.get(cfg.framework, {}), overrides, cfg.framework, adm)
    mirror = getattr(fw, "mirror_aliases", None)
    if mirror is not None:
        resolved[cfg.framework] = mirror(resolved[cfg.framework])
    resolved["stack"] = _files.versions(src.get("stack", {}))
    if "distributed" in src:
        resolved["distributed"] = {"num_processes": adm.processes}
    adm.resolved = resolved
    try:
        # a declared systems-only knob is no part of the update's contract: its source value stands in
        adm.contract = fw.contract(_with_source_values(resolved, src, adm.allowed))
    except RefusedError as exc:
        adm.refuse(exc.diagnostics())
        return
    check_contract(adm, m.contract, m.doc["contract"]["sha256"], adm.contract)
    check_entry = getattr(producer_module(cfg.framework), "check_entry", None)
    if check_entry is not None:
        why = check_entry(cfg.entry, m.doc["framework_state"].get("entry"))
        if why:
            adm.refuse(f"integration.entry: {why}")
    elif cfg.entry:
        adm.refuse(f"integration.entry is not used by framework {cfg.framework!r}; remove it")
    admissible = {k: f"systems-only knob of {cfg.framework}" for k in knobs.knobs_for(cfg.framework)}
    admissible.update({k: "stack difference, admitted for the approximate claim only" for k in knobs.stack_keys(src)})
    ignored = getattr(fw, "ignored", None)
    adm.observed = check_differences(adm, src, resolved, adm.allowed, admissible,
                                     ignored=lambda k: _ignored(k) or bool(ignored is not None and ignored(k)))
    refusals = getattr(fw, "knob_refusals", None)
    if refusals is not None:
        for reason in refusals(adm):
            adm.refuse(reason)


def _check_runner(adm: Admission) -> None:
    """Nothing of the capture API's own: its source-run settings are the shared admission's
    (:func:`replayjob.producers.admission.check_source_settings`)."""
    assert adm.cfg is not None


@dataclass(frozen=True)
class ApiKind:
    """The capture API's captures (every producer but the built-in trainer), as
    :func:`replayjob.producers.admission.admit` checks them."""

    manifest_type: tuple[type, ...] = (Manifest,)  # a root over processes is a Manifest too
    manifest_name: str = "optimizer_batch_step_<K>.manifest.json"
    writer: str = "the capture API"

    def runner(self, adm: Admission) -> None:
        _check_runner(adm)

    def payload(self, adm: Admission) -> None:
        _check_payload(adm)

    def state(self, adm: Admission) -> None:
        _check_state(adm)

    def model(self, adm: Admission) -> None:
        _check_base_model(adm)
        _check_routing(adm)

    def config(self, adm: Admission) -> None:
        _check_config(adm)


KIND = ApiKind()


def admit(cfg: ReplayConfig, processes: int | None = None, manifest: PinnedManifest | None = None) -> Admission:
    """Run every admission check (:func:`replayjob.producers.admission.admit`, this kind's checks); never raises
    for a failed check (see :meth:`Admission.raise_if_refused`).

    ``processes``: how many processes the replay will run on (default: this process's launcher's);
    ``manifest``: the capture's manifest as the caller already verified it (used when it is the one the config
    pins, so its bytes are read once)."""

    adm = Admission(cfg=cfg, processes=launch_env().world_size if processes is None else processes,
                    given=manifest)
    shared.admit(adm, KIND)
    return adm


def report(adm: Admission) -> dict[str, Any]:
    """What was verified and what a replay would do (the ``--json`` output; the built-in report's keys)."""
    m, cfg = adm.manifest, adm.cfg
    assert cfg is not None
    mbs = adm.micro_batches or []
    recorded = m.doc["framework_state"].get("precision") if m else None
    prec = recorded if isinstance(recorded, dict) else None
    return {
        "admitted": adm.admitted,
        "reasons": list(adm.reasons),
        "pins": dict(adm.pins),
        "framework": cfg.framework,
        "manifest": {"path": str(m.path), "sha256": m.sha256, "step": m.step} if m else None,
        "payload": ({"path": str(m.file("payload")),
                     "size": sum(p.doc["files"]["payload"]["size"] for p in getattr(m, "parts", ()) or (m,)),
                     "sha256": m.payload_digest} if m else None),
        "rows": None,
        "micro_batches": m.doc["rows"] if m else None,
        "optimizer/logical_batch_sha256": m.logical_sha256 if m and adm.micro_batches is not None else None,
        "optimizer/local_effective_rows_sha256": m.effective_sha256 if m and adm.micro_batches is not None else None,
        "initial_adapter": {"path": str(m.file("adapter")), "sha256": m.initial_adapter_sha256} if m else None,
        "base_model": m.doc["base_model"]["path"] if m else None,
        "contract_sha256": sha256_json(adm.contract) if adm.contract is not None else None,
        "allowed_config_differences": list(adm.allowed),
        "observed_config_differences": list(adm.observed),
        "knobs": adm.knob_values(),
        "arm": adm.arm,
        "rng_states": sorted({k for mb in mbs for k in mb.rng}) or None,
        # the precision the captured update computed in (a capture from before it was recorded: null), and the
        # approximate claim's tolerances it suggests for systems changes (replayjob.producers.api.precision)
        "precision": prec,
        "suggested_tolerances": precision.suggested_tolerances(prec) if prec else None,
        "skipped": list(SKIPPED),
        "would": [
            f"build the {cfg.framework} trainer on the base model {cfg.model['path']} (no dataset, no reward "
            "function, no generation)",
            "load the captured adapter, optimizer and LR-scheduler state",
            f"run the {len(mbs)} captured micro-batch(es) through the framework's own training step, each after "
            "restoring the Torch RNG state captured before its loss call",
            "clip gradients, optimizer step, scheduler step, zero grad (once)",
            "save final_adapter/ and replay_metrics.json",
        ],
    }


def explain(config: str | Path, overrides: list[str], manifest: PinnedManifest | None = None,
            processes: int | None = None) -> tuple[Admission, dict[str, Any]]:
    """``replayjob explain`` for an integration replay config (``manifest``, ``processes``: as :func:`admit` takes
    them; ``explain --nproc N`` passes N, the count ``replay --nproc N`` admits with before it launches)."""
    adm = admit(load(config, overrides), processes=processes, manifest=manifest)
    return adm, report(adm)
