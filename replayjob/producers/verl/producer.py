"""verl integration: capture optimizer steps of a real verl actor update, and replay one with verl's own engine.

Capture (``pip install 'replayjob[verl]'``), in the process that holds the actor's engine (verl's
``TrainingWorker``, or the ``ActorRolloutRefWorker`` whose ``actor`` it is), after its model is built; ``step=3``
is the 4th optimizer step of the run, the trainer then runs ``update_actor`` as usual, and
``cap.result.replay_toml`` is ``runs/cap/replay.toml`` with its pins filled in:

    >>> from replayjob import capture_actor_steps  # doctest: +SKIP
    >>> cap = capture_actor_steps(worker, "runs/cap", step=3)  # doctest: +SKIP
    >>> cap.result.replay_toml  # doctest: +SKIP

In a Ray run the worker lives in its own process: :mod:`replayjob.producers.verl.plugin`, imported there
through verl's ``actor_rollout_ref.model.external_lib`` setting, makes the same call from the environment
(docs/verl.md).  A *step* is one optimizer step: one call of the engine's ``train_batch`` (zero-grad, forward
and backward over the engine's micro-batches, clip and optimizer step, skipped on a non-finite gradient
norm).  ``TrainingWorker.train_mini_batch`` runs ``ppo_epochs`` x (mini-batches) of them per ``update_actor``
call and steps the LR scheduler after the last; the manifest's ``framework_state`` records which update,
epoch and mini-batch the captured step was.  Steps are counted from 0 from the call on (``first_step`` for a
run resumed at another count).

What is recorded: the mini-batch ``TensorDict`` the engine's ``train_batch`` received, as safetensors (dense
tensors as they are; jagged nested tensors as their ``values`` and ``offsets``) plus its non-tensor entries as
JSON (never verl's pickle dumps); the engine's systems settings that travel in the batch
(``use_remove_padding``, ``use_dynamic_bsz``, ``micro_batch_size_per_gpu``, ``max_token_len_per_gpu``,
``use_fused_kernels``) are checked against the engine config and recorded there; the Torch RNG state right
before the step; the trainable parameters (the LoRA adapter, or every parameter for full fine-tuning) and the
AdamW state as full tensors (gathered from FSDP2's DTensors); the LR scheduler state (in ``framework_state``: verl
steps it once per update, not once per optimizer step); and the four config
sections of :mod:`replayjob.producers.verl.fields` (every field classified).

Replay (:func:`build_replay`) runs without Ray and without rollout: it builds verl's FSDP engine
(``EngineRegistry.new``, ``initialize``) from the pinned base model directory and the captured config
sections, on the CPU through :mod:`replayjob.producers.verl.platform` when there is no CUDA, copies the
captured parameters and optimizer and scheduler state in (re-hashed), restores the RNG, and runs exactly what
``BaseEngine.train_batch`` runs on the captured batch with verl's ``ppo_loss`` (``optimizer_zero_grad``,
``forward_backward_batch``, ``optimizer_step``), then ``lr_scheduler_step`` when the captured batch says
``update_lr_scheduler``.  Over several data-parallel processes each captures its share as a part and a replay
runs on as many (``--nproc N``).  This module imports verl, torch and
tensordict only inside functions, so ``explain`` uses :func:`contract` without them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from replayjob.artifacts.capture_root import rank_dir
from replayjob.digest import sha256_bytes
from replayjob.errors import ConfigError, ContractError, UsageError
from replayjob.fsio import atomic_write_bytes
from replayjob.producers.api import capture as cap
from replayjob.producers.api import files as _files
from replayjob.producers.api import microbatch as _microbatch
from replayjob.producers.api import parts as iranks
from replayjob.producers.api.admission import Admission
from replayjob.producers.api.replay import ReplaySession
from replayjob.producers.contract import integration_contract
from replayjob.producers.session import MicroStep
from replayjob.producers.verl.fields import CONTRACT, FIELDS, REFUSED, SECTIONS, classify, config_reasons, value_reason
from replayjob.producers.verl.platform import use_cpu
from replayjob.rl.state import adapter_bytes, join_optimizer_state, scheduler_type_reasons
from replayjob.runtime import knobs

if TYPE_CHECKING:
    import torch

FRAMEWORK = "verl"
RANKS = True  # a capture over several data-parallel processes replays over as many (replayjob replay --nproc N)
TESTED = {"verl": "0.9.1"}
STACK = ("torch", "transformers", "peft", "verl", "tensordict")
LOSSES = ("ppo_loss",)  # the loss functions of verl.workers.utils.losses a capture takes
SEQUENCE = ("BaseEngine.train_batch on the captured mini-batch: optimizer_zero_grad; forward_backward_batch "
            "(ppo_loss over the engine's micro-batches); optimizer_step (clip to optim.clip_grad, skipped on a "
            "non-finite norm); then lr_scheduler_step when the batch's update_lr_scheduler is set")
# non-tensor entries of the batch that carry engine settings: batch key -> verl.engine field
ENGINE_KEYS = {"use_remove_padding": "use_remove_padding", "use_dynamic_bsz": "use_dynamic_bsz",
               "micro_batch_size_per_gpu": "micro_batch_size_per_gpu",
               "max_token_len_per_gpu": "max_token_len_per_gpu", "use_fused_kernels": "use_fused_kernels"}
OFFSETS = "__offsets"  # a jagged tensor <key> is captured as <key> (its values) and <key>__offsets


# -- config sections --------------------------------------------------------------------------------

def jsonable(value: Any) -> Any:
    """A verl config value as JSON: dataclasses and OmegaConf containers as objects, enums by value, tuples as
    lists; anything else is refused by the capture (never written as its repr)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        pass
    else:
        if isinstance(value, DictConfig | ListConfig):
            return jsonable(OmegaConf.to_container(value, resolve=True))
    raise cap.CaptureError(f"a verl config value of type {type(value).__name__} cannot be recorded as JSON",
                           where="verl config")


def section_values(section: str, obj: Any) -> dict[str, Any]:
    """The recorded fields of one config dataclass (contract, knob and refused ones), every field classified and
    every refused one at an admitted value; a CaptureError names the first field that is not."""
    if not dataclasses.is_dataclass(obj):
        raise cap.CaptureError(f"verl.{section} is a {type(obj).__name__}, not verl's "
                               f"{SECTIONS[section][1]}", where=f"verl.{section}")
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        kind = classify(section, f.name)
        if kind is None:
            raise cap.CaptureError(f"verl.{section}.{f.name} is not classified for this verl version (contract, "
                                   "systems knob, irrelevant or refused)", where=f"verl.{section}.{f.name}",
                                   hint=f"replayjob is tested with verl {TESTED['verl']}; classify the field in "
                                        "replayjob/producers/verl/fields.py")
        if not kind.recorded:
            continue
        value = jsonable(getattr(obj, f.name))
        if (section, f.name) == ("engine", "mixed_precision"):
            value = effective_precision(value)
        reason = value_reason(section, f.name, value)  # the rule admission reads the recorded value by (fp16 too)
        if reason is not None:
            raise cap.CaptureError(reason, where=f"verl.{section}.{f.name}", hint="capture a run without it")
        out[f.name] = value
    return out


# what verl's FSDP engine builds when FSDPEngineConfig.mixed_precision is unset, and for an entry a table omits
PRECISION_DEFAULTS = {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def effective_precision(value: Any) -> dict[str, Any]:
    """verl's ``mixed_precision`` as its engine resolves it: unset means bf16 parameters (and autocast) with fp32
    reduction and buffers, and an entry a table leaves out takes that default; so a capture records every entry
    and a replay may change one (a table-valued knob compared entry by entry)."""
    if value is None:
        return dict(PRECISION_DEFAULTS)
    if not isinstance(value, dict):
        raise cap.CaptureError(f"verl.engine.mixed_precision is {value!r}, not a table", where="verl.engine")
    return {**PRECISION_DEFAULTS, **value}


def canonical_names(captured: dict[str, Any], overrides: dict[str, Any],
                    allowed: list[str]) -> tuple[dict[str, Any], list[str], list[str]]:
    """A replay's ``--set verl.engine.mixed_precision.<entry>=...`` completed with the captured table's other
    entries (an override of one entry replaces the table: this keeps the others as captured)."""
    engine = overrides.get("engine")
    mp = engine.get("mixed_precision") if isinstance(engine, dict) else None
    have = (captured.get("engine") or {}).get("mixed_precision")
    if not isinstance(engine, dict) or not isinstance(mp, dict) or not isinstance(have, dict):
        return overrides, allowed, []
    return {**overrides, "engine": {**engine, "mixed_precision": {**have, **mp}}}, allowed, []


def contract(resolved: dict[str, Any]) -> dict[str, Any]:
    """The verl update's contract from a resolved config (pure: no verl import): every contract and refused field
    of the four sections, and the loss function."""
    v = resolved.get(FRAMEWORK, {})
    v = v if isinstance(v, dict) else {}  # a section of another shape is refused by knob_refusals (config_reasons)
    update: dict[str, Any] = {
        section: {name: _table(v.get(section)).get(name) for name, f in fields.items()
                  if f.kind in (CONTRACT, REFUSED)}
        for section, fields in FIELDS.items()}
    update["loss"] = v.get("loss")
    if update["loss"] not in LOSSES:
        raise ConfigError(f"the capture's loss {update['loss']!r} is not one replayjob replays",
                          where="verl.loss", hint="losses: " + ", ".join(LOSSES))
    return integration_contract(FRAMEWORK, update, SEQUENCE)


def _table(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


# -- the batch --------------------------------------------------------------------------------------

def encode_batch(data: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A verl mini-batch ``TensorDict`` as the inputs of one recorded call (tensors by name, JSON values), and the
    engine settings it carries (:data:`ENGINE_KEYS`, removed from the inputs)."""
    import torch
    from tensordict import NonTensorData, NonTensorStack, TensorDictBase

    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    stacks: dict[str, Any] = {}
    nested: list[str] = []
    wrapped: list[str] = []  # NonTensorData holding a tensor (verl's unpad "indices"): captured as a tensor
    for key in sorted(data.keys()):
        if not isinstance(key, str) or not key or "." in key or key.endswith(OFFSETS):
            raise cap.CaptureError(f"batch key {key!r} cannot be captured (a nested key, or a name the capture "
                                   "uses itself)", where="verl batch")
        v = data.get(key)
        where = f"verl batch {key}"
        if isinstance(v, NonTensorData) and isinstance(v.data, torch.Tensor):
            tensors[key] = v.data
            wrapped.append(key)
        elif isinstance(v, NonTensorData):
            plain[key] = _batch_value(v.data, where)
        elif isinstance(v, NonTensorStack):
            stacks[key] = _batch_value(v.tolist(), where)
        elif isinstance(v, TensorDictBase):
            raise cap.CaptureError("a nested TensorDict in the update batch is not captured", where=where)
        elif isinstance(v, torch.Tensor) and v.is_nested:
            jagged: Any = v  # a NestedTensor (torch's stubs type it as a Tensor)
            if v.layout != torch.jagged or jagged.lengths() is not None:
                raise cap.CaptureError("only contiguous jagged nested tensors are captured", where=where)
            tensors[key] = jagged.values()
            tensors[key + OFFSETS] = jagged.offsets()
            nested.append(key)
        elif isinstance(v, torch.Tensor):
            tensors[key] = v
        else:
            raise cap.CaptureError(f"a {type(v).__name__} in the update batch is not captured", where=where)
    engine = {field: plain.pop(key) for key, field in ENGINE_KEYS.items() if key in plain}
    batch = {"batch_size": [int(s) for s in data.batch_size], "non_tensor": plain, "non_tensor_stacks": stacks,
             "nested": nested, "non_tensor_tensors": wrapped}
    return {**tensors, "batch": batch}, engine


def _batch_value(value: Any, where: str) -> Any:
    try:
        return _microbatch.captured_json(jsonable(value), where)
    except cap.CaptureError as exc:
        raise cap.CaptureError(f"{exc.message} (the verl batch entry cannot be recorded as JSON)", where=where,
                               hint="capture a batch whose non-tensor entries are numbers, strings or lists") from None


def decode_batch(inputs: dict[str, Any], engine: dict[str, Any]) -> Any:
    """The mini-batch ``TensorDict`` again from :func:`encode_batch`'s inputs, with the engine settings
    ``engine`` (the replay's: a declared knob's value is the replay's own) set as the engine reads them."""
    import torch
    from tensordict import NonTensorData, TensorDict
    from verl.utils import tensordict_utils as tu

    meta = inputs["batch"]
    source: dict[str, Any] = {}
    for key, t in inputs.items():
        if key == "batch" or key.endswith(OFFSETS):
            continue
        if key in meta["nested"]:
            source[key] = torch.nested.nested_tensor_from_jagged(t, inputs[key + OFFSETS])
        elif key in meta["non_tensor_tensors"]:
            continue
        else:
            source[key] = t
    td = TensorDict(source=source, batch_size=meta["batch_size"])
    for key, value in meta["non_tensor"].items():
        td[key] = NonTensorData(value)
    for key in meta["non_tensor_tensors"]:
        td[key] = NonTensorData(inputs[key])
    for key, values in meta["non_tensor_stacks"].items():
        tu.assign_non_tensor_stack(td, key, values)
    for key, field in ENGINE_KEYS.items():
        if field in engine:
            td[key] = NonTensorData(engine[field])
    return td


def reported_loss(losses: list[Any], world: int) -> float:
    """The step's loss as verl's TrainingWorker reports it: the micro-batch losses summed as a float32 tensor and
    averaged over the data-parallel processes."""
    import torch
    import torch.distributed as dist

    total = torch.sum(torch.tensor(losses, dtype=torch.float32))
    if world > 1:
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return float(total.item())


# -- another process count at replay than at capture ------------------------------------------------

def shares_differ(mbs: list[_microbatch.MicroBatch]) -> str | None:
    """Why the captured processes' shares (one ``train_batch`` each, in rank order) cannot be joined into one
    mini-batch (``None``: they can): a setting or a whole-batch entry that differs between them, or per-row
    tensors of different widths."""
    import torch

    first = mbs[0].input_values["batch"]
    for r, mb in enumerate(mbs[1:], 1):
        meta = mb.input_values["batch"]
        for part in ("non_tensor", "nested", "non_tensor_tensors"):
            if meta[part] != first[part]:
                keys = sorted(k for k in {*meta[part], *first[part]} if meta[part].get(k) != first[part].get(k)) \
                    if isinstance(meta[part], dict) else []
                return f"process {r}'s batch {part} {keys or meta[part]} differs from process 0's"
        if sorted(mb.inputs) != sorted(mbs[0].inputs) or sorted(meta["non_tensor_stacks"]) != sorted(
                first["non_tensor_stacks"]):
            return f"process {r}'s batch holds other entries than process 0's"
        for key in first["non_tensor_tensors"]:
            if not torch.equal(mb.inputs[key], mbs[0].inputs[key]):
                return f"process {r}'s whole-batch tensor {key!r} differs from process 0's"
        for key, t in mb.inputs.items():
            if key.endswith(OFFSETS) or key in first["nested"] or key in first["non_tensor_tensors"]:
                continue
            if t.shape[1:] != mbs[0].inputs[key].shape[1:]:
                return f"process {r}'s {key!r} is {list(t.shape)}, process 0's {list(mbs[0].inputs[key].shape)}"
    return None


def _rows(mb: _microbatch.MicroBatch) -> int:
    return int(mb.input_values["batch"]["batch_size"][0])


def regrouped(mbs: list[_microbatch.MicroBatch], rank: int, world: int) -> _microbatch.MicroBatch:
    """Process ``rank``'s share of the mini-batch for a replay on ``world`` processes: the captured shares joined
    in rank order (per-row tensors concatenated, jagged ones with their offsets, per-row lists joined; settings
    and whole-batch entries, equal in every share (:func:`shares_differ`), kept once), then its contiguous
    ``1/world`` of the rows."""
    import torch

    first = mbs[0]
    meta = first.input_values["batch"]
    nested, whole = meta["nested"], meta["non_tensor_tensors"]
    total = sum(_rows(mb) for mb in mbs)
    per = total // world
    lo, hi = rank * per, (rank + 1) * per
    inputs: dict[str, Any] = {}
    for key, t in first.inputs.items():
        if key.endswith(OFFSETS):
            continue
        if key in whole:
            inputs[key] = t
        elif key in nested:
            joined = torch.cat([mb.inputs[key] for mb in mbs])
            ends = [0]
            for mb in mbs:
                ends += [ends[-1] + int(o) for o in mb.inputs[key + OFFSETS][1:]]
            offsets = torch.tensor(ends, dtype=first.inputs[key + OFFSETS].dtype)
            inputs[key] = joined[int(offsets[lo]):int(offsets[hi])].clone()
            inputs[key + OFFSETS] = offsets[lo:hi + 1] - offsets[lo]
        else:
            inputs[key] = torch.cat([mb.inputs[key] for mb in mbs])[lo:hi].clone()
    stacks = {k: [v for mb in mbs for v in mb.input_values["batch"]["non_tensor_stacks"][k]][lo:hi]
              for k in meta["non_tensor_stacks"]}
    values = {**first.input_values, "batch": {**meta, "batch_size": [per, *meta["batch_size"][1:]],
                                              "non_tensor_stacks": stacks}}
    return dataclasses.replace(first, inputs=inputs, input_values=values)


# -- full tensors from FSDP2's DTensors --------------------------------------------------------------

def full(t: Any) -> Any:
    """``t`` as a plain tensor: a DTensor gathered (a collective: every rank calls it in the same order)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class FullParameters:
    """The engine module's trainable parameters as full tensors, under their names (what the capture API reads
    as a model: ``named_parameters``), gathered afresh at each call until :meth:`freeze` (gathering is a
    collective: after the step every process freezes them once, so that process 0 alone can write them)."""

    def __init__(self, module: Any):
        self.module = module
        self.frozen: dict[str, Any] | None = None

    def freeze(self) -> None:
        self.frozen = {name: full(p.detach()) for name, p in self.module.named_parameters() if p.requires_grad}

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        if self.frozen is not None:
            for name, t in self.frozen.items():
                yield name, t.detach().requires_grad_(True)
            return
        for name, p in self.module.named_parameters():
            if p.requires_grad:
                yield name, full(p.detach()).requires_grad_(True)


class FullOptimizer:
    """The engine's optimizer with its state dict's DTensors gathered (what the capture API reads)."""

    def __init__(self, optimizer: Any):
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        return {"state": {i: {k: full(v) for k, v in e.items()} for i, e in sd["state"].items()},
                "param_groups": sd["param_groups"]}


# -- capture ----------------------------------------------------------------------------------------

def _training_worker(worker: Any) -> Any:
    inner = getattr(worker, "actor", None)
    return inner if inner is not None and hasattr(inner, "engine") else worker


def _loss_config(loss_fn: Any) -> Any:
    """The actor config of the worker's loss (``functools.partial(ppo_loss, config=...)``), refused otherwise."""
    func = getattr(loss_fn, "func", None)
    name = getattr(func, "__name__", type(loss_fn).__name__)
    module = getattr(func, "__module__", "")
    if not isinstance(loss_fn, functools.partial) or module != "verl.workers.utils.losses" or name not in LOSSES:
        raise cap.CaptureError(f"the worker's loss is {module}.{name}; replayjob replays "
                               + ", ".join(f"verl.workers.utils.losses.{n}" for n in LOSSES), where="worker.loss_fn",
                               hint="capture the actor's update (ActorRolloutRefWorker sets partial(ppo_loss, ...))")
    config = loss_fn.keywords.get("config")
    if config is None:
        raise cap.CaptureError("the worker's loss has no config", where="worker.loss_fn")
    return name, config


def capture_config(worker: Any) -> dict[str, Any]:
    """The ``verl`` section a capture records for ``worker`` (a ``TrainingWorker`` whose model is built and whose
    loss is set): the four classified config sections and the loss's name."""
    w = _training_worker(worker)
    engine = getattr(w, "engine", None)
    if engine is None or getattr(engine, "module", None) is None:
        raise cap.CaptureError("the worker's engine is not built", where="worker.engine",
                               hint="call capture_actor_steps after the worker's init_model / reset")
    name, actor = _loss_config(getattr(w, "loss_fn", None))
    return {"loss": name, "actor": section_values("actor", actor),
            "engine": section_values("engine", engine.engine_config),
            "optim": section_values("optim", engine.optimizer_config),
            "model": section_values("model", engine.model_config)}


class VerlCapture:
    """The instrumentation :func:`capture_actor_steps` installs on a worker (see the module docstring)."""

    def __init__(self, worker: Any, out_dir: Path, steps: tuple[int, ...], *, several: bool, first_step: int):
        import torch.distributed as dist

        self.worker = _training_worker(worker)
        self.engine = self.worker.engine
        self.steps, self.several = steps, several
        self.next_step = first_step
        self.config = {FRAMEWORK: capture_config(self.worker)}
        # data parallel over several processes: each captures its own mini-batch shard as a part in rank-<r>/ and
        # process 0 writes the root (integrations.ranks); the parameters and optimizer state are gathered full on
        # every process, so the parts agree
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        base = self.engine.model_config.local_path or self.engine.model_config.path
        self.base_dir = str(Path(str(base)).resolve())
        self.config["model"] = {"path": self.base_dir}
        self._out = out_dir
        self._cap: cap.StepCapture | None = None
        self._chosen: cap.ChosenSteps | None = None
        self._base_model: dict[str, Any] | None = None
        if self.world > 1:
            if several:
                raise cap.CaptureError(f"steps=[...] is captured in one process; this run has {self.world}",
                                       where="steps", hint="capture one step (step=K) of a run over several processes")
            if int(self.engine.get_data_parallel_size()) != self.world:
                raise cap.CaptureError(f"the engine's data-parallel size is {self.engine.get_data_parallel_size()} "
                                       f"over {self.world} processes (sequence or model parallelism)",
                                       where="verl engine", hint="capture a data-parallel FSDP2 run")
            self.config["distributed"] = {"num_processes": self.world}  # one-process captures record none
            iranks.refuse_existing(out_dir, self.rank, steps[0])
            self._base_model = _files.base_model_identity(self.base_dir)
        elif several:
            self._chosen = cap.ChosenSteps(out_dir, steps=steps, framework=FRAMEWORK, base_model_dir=self.base_dir,
                                           config=self.config, stack=STACK)
        else:
            _files.refuse_existing(out_dir, _files.capture_file_names(steps[0], several=False))
            self._base_model = _files.base_model_identity(self.base_dir)
        self._position: dict[str, int] = {"update": -1, "mini_batch": 0, "epoch": 0, "mini_batches": 1, "epochs": 1}
        self._result: cap.CaptureResult | None = None
        self._wrap()

    # the wrappers read state and consume no random numbers
    def _wrap(self) -> None:
        worker, engine, handle = self.worker, self.engine, self
        mini = worker.train_mini_batch
        train = engine.train_batch

        def train_mini_batch(data: Any, *args: Any, **kwargs: Any) -> Any:
            from verl.utils import tensordict_utils as tu
            size = tu.get(data, "mini_batch_size", None)
            count = tu.get(data, "num_mini_batch", None)
            rows = int(data.shape[0])  # this process's share; the mini-batch size is the global one
            per = (rows * engine.get_data_parallel_size() // int(size)) if size else int(count or 1)
            handle._position = {"update": handle._position["update"] + 1, "mini_batch": 0, "epoch": 0,
                                "mini_batches": per, "epochs": int(tu.get(data, "epochs", 1) or 1), "index": 0}
            return mini(data, *args, **kwargs)

        def train_batch(data: Any, loss_function: Any) -> Any:
            return handle._train_batch(train, data, loss_function)

        worker.train_mini_batch = train_mini_batch
        engine.train_batch = train_batch

    def _position_now(self) -> dict[str, int]:
        p = self._position
        index = p.get("index", 0)
        p["index"] = index + 1
        per = max(p["mini_batches"], 1)
        return {"update": p["update"], "epoch": index // per, "mini_batch": index % per,
                "mini_batches_per_epoch": per, "epochs": p["epochs"]}

    def _train_batch(self, train: Any, data: Any, loss_function: Any) -> Any:
        k = self.next_step
        self.next_step += 1
        position = self._position_now()
        c = self._open(k, position)
        if c is None:
            return train(data, loss_function)
        try:
            inputs, carried = encode_batch(data)
            engine_cfg = self.config[FRAMEWORK]["engine"]
            differ = {f: v for f, v in carried.items() if engine_cfg.get(f) != v}
            if differ:
                raise cap.CaptureError(f"the batch carries engine settings {differ} that differ from the engine's "
                                       f"config ({ {f: engine_cfg.get(f) for f in differ} })",
                                       where="verl batch", hint="set them in the engine config, not in the batch")
            if loss_function is not self.worker.loss_fn:
                raise cap.CaptureError("the engine's train_batch was called with another loss than the worker's",
                                       where="engine.train_batch")
            c.begin()
            c.record(inputs)  # the RNG state right before the step
        except BaseException:
            c.abandon()
            raise
        out = train(data, loss_function)
        after: Any = c.model
        after.freeze()  # the parameters after the step, gathered once on every process
        losses = out.get("loss", []) if isinstance(out, dict) else []
        c.add_loss(reported_loss(losses, self.world))  # TrainingWorker's reported loss of the step
        grad_norm = out["metrics"].get("grad_norm") if isinstance(out, dict) else None
        res = c.finish(grad_norm=None if grad_norm is None else float(grad_norm))
        if self.world > 1:  # land; process 0 writes the root
            self._result = iranks.finish(self._out, c, self.rank, self.world)
        elif self._chosen is None:
            self._result = res
        elif all(s in self._chosen.captures and self._chosen.captures[s].result is not None for s in self.steps):
            self._chosen.close()  # every chosen step is captured: metrics.json, last
        return out

    def _open(self, k: int, position: dict[str, int]) -> cap.StepCapture | None:
        if k not in self.steps:
            return None
        # verl steps its LR scheduler once per update (after the last mini-batch), not once per optimizer step: its
        # state travels in framework_state, where it means what verl means by it (restore_state loads it)
        live: dict[str, Any] = {"model": FullParameters(self.engine.module),
                                "optimizer": FullOptimizer(self.engine.optimizer), "scheduler": None}
        sched = self.engine.lr_scheduler
        state = {"position": position, "optimizer_step": k, "world_size": self.world,
                 "lr_scheduler": None if sched is None else _microbatch.captured_json(sched.state_dict(),
                                                                                       "verl LR scheduler state")}
        if self._chosen is not None:
            return self._chosen.at(k, framework_state=state, **live)
        part = self.world > 1
        return cap.StepCapture(self._out / rank_dir(self.rank) if part else self._out, step=k, framework=FRAMEWORK,
                               base_model_dir=self.base_dir, config=self.config, framework_state=state, stack=STACK,
                               base_model=self._base_model, part=part, **live)

    @property
    def result(self) -> cap.CaptureResult:
        """The pins of a ``step=K`` capture once step K finished."""
        if self._result is None:
            raise cap.CaptureError(f"optimizer step {self.steps[0]} has not been captured (the engine ran "
                                   f"{self.next_step} step(s) since the capture was installed)",
                                   where=str(self._out), hint="run the update that reaches it")
        return self._result

    def close(self) -> cap.StepsResult:
        """``steps=[...]``: write ``metrics.json`` with the steps captured so far (idempotent; done by itself
        once every chosen step is captured)."""
        if self._chosen is None:
            raise UsageError("close() is for a capture of several steps (steps=[...])", where="VerlCapture.close")
        return self._chosen.close()


def capture_actor_steps(worker: Any, out_dir: str | Path, step: int | None = None, *,
                        steps: Iterable[int] | None = None, first_step: int = 0) -> VerlCapture:
    """Capture optimizer step ``step`` (or each of ``steps``) of the actor update run by ``worker``: verl's
    ``TrainingWorker`` (or an ``ActorRolloutRefWorker``, whose ``actor`` it takes) after its model is built and
    its loss set.  Steps are 0-based optimizer steps (engine ``train_batch`` calls) counted from this call on,
    starting at ``first_step``.  ``step=K`` writes one capture with ``replay.toml``, ``metrics.json`` and
    ``final_adapter/`` (``result``); ``steps=[...]`` writes each step's files and ``replay_step_<K:06d>.toml``,
    and ``metrics.json`` once every chosen step is captured (or at ``close()``).  Refused at once (nothing
    written): both or neither-valid ``step``/``steps``, a worker whose loss is not verl's ``ppo_loss``, a config
    field that is not classified or holds a refused value, ``steps=[...]`` over several processes (each process
    calls this for one step: its share becomes a part, process 0 writes the root), model or sequence
    parallelism, a base model not in a local directory with safetensors weights, and files of a chosen step
    already in ``out_dir``."""
    if step is not None and steps is not None:
        raise UsageError("give one of step=K and steps=[K, ...], not both", where="capture_actor_steps")
    if step is None and steps is None:
        step = 0
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise UsageError(f"step must be an integer >= 0, found {step!r}", where="step")
    if isinstance(first_step, bool) or not isinstance(first_step, int) or first_step < 0:
        raise UsageError(f"first_step must be an integer >= 0, found {first_step!r}", where="first_step")
    chosen = (step,) if step is not None else _files.chosen_steps(steps)
    early = [k for k in chosen if k < first_step]
    if early:
        raise UsageError(f"step(s) {early} come before first_step {first_step}", where="steps")
    return VerlCapture(worker, Path(out_dir), chosen, several=steps is not None, first_step=first_step)


# -- knobs ------------------------------------------------------------------------------------------

# policy losses that select tokens by statistics over each micro-batch (the covariance-based clip and KL)
MICRO_BATCH_STATISTICS = ("clip_cov", "kl_cov")


def knob_refusals(adm: Admission) -> list[str]:
    """Why a declared verl knob does not hold for this capture and replay (beyond being registered and present)."""
    v = (adm.resolved or {}).get(FRAMEWORK, {})
    # the recorded sections as a capture writes them (a re-pinned manifest's too): the checks below read them
    why = config_reasons(v)
    if adm.manifest is not None:
        why += scheduler_presence_reasons(adm.manifest.config.get(FRAMEWORK), adm.manifest.doc["framework_state"])
    if why:
        return why
    if knobs.VERL_MICRO_BATCH in adm.allowed:
        mode = ((v.get("actor") or {}).get("policy_loss") or {}).get("loss_mode", "vanilla")
        if mode in MICRO_BATCH_STATISTICS:
            why.append(f"{knobs.VERL_MICRO_BATCH}: policy loss {mode!r} selects tokens by statistics over each "
                       "micro-batch, so another split changes which tokens it clips")
        if (v.get("engine") or {}).get("use_dynamic_bsz"):
            why.append(f"declared difference {knobs.VERL_MICRO_BATCH!r} is not present: the engine splits by token "
                       "budget (use_dynamic_bsz) and does not use the micro-batch size")
    engine = v.get("engine") or {}
    mp = engine.get("mixed_precision") or {}
    if knobs.VERL_PARAM_DTYPE in adm.allowed and knobs.verl_precision(mp.get("param_dtype")) == "fp16":
        why.append(f"{knobs.VERL_PARAM_DTYPE} = fp16 is not replayed: verl computes fp16 with a gradient scaler "
                   "whose state the capture does not hold")
    if knobs.VERL_MAX_TOKENS in adm.allowed and not engine.get("use_dynamic_bsz"):
        why.append(f"declared difference {knobs.VERL_MAX_TOKENS!r} is not present: the engine splits by row count "
                   "(use_dynamic_bsz is false) and does not use the token budget")
    pair = (knobs.VERL_REMOVE_PADDING, knobs.VERL_REMOVE_PADDING_MODEL)
    declared = [k for k in pair if k in adm.allowed]
    model = v.get("model") or {}
    if declared and (len(declared) == 1 or engine.get("use_remove_padding") != model.get("use_remove_padding")):
        why.append(f"{pair[0]} and {pair[1]} are one setting (the engine packs rows as the model was patched to "
                   "read them): declare both and set them to the same value")
    if knobs.NUM_PROCESSES in adm.allowed:
        mode = ((v.get("actor") or {}).get("policy_loss") or {}).get("loss_mode", "vanilla")
        if mode in MICRO_BATCH_STATISTICS:
            why.append(f"{knobs.NUM_PROCESSES}: policy loss {mode!r} selects tokens by statistics over each "
                       "process's micro-batches, so another split changes which tokens it clips")
        shares = adm.rank_micro_batches or ([adm.micro_batches] if adm.micro_batches else [])
        if any(len(share) != 1 for share in shares):
            why.append(f"{knobs.NUM_PROCESSES}: each captured process holds one train_batch call; this capture "
                       "holds another count")
        elif shares:
            mbs = [share[0] for share in shares]
            rows = sum(_rows(mb) for mb in mbs)
            differ = shares_differ(mbs)
            if differ is not None:
                why.append(f"{knobs.NUM_PROCESSES}: the captured processes' shares cannot be joined: {differ}")
            elif rows % adm.processes:
                why.append(f"{knobs.NUM_PROCESSES}: the mini-batch's {rows} rows do not split evenly over "
                           f"{adm.processes} processes")
    if engine.get("use_dynamic_bsz") and not engine.get("max_token_len_per_gpu"):
        why.append("verl.engine.use_dynamic_bsz needs verl.engine.max_token_len_per_gpu (the token budget of a "
                   "micro-batch)")
    return why


def scheduler_presence_reasons(recorded: Any, state: Any) -> list[str]:
    """Why a capture's null ``framework_state.lr_scheduler`` contradicts its recorded config (empty: it does not):
    verl's FSDP engine builds an LR scheduler with its optimizer (``_build_lr_scheduler``: constant or cosine,
    ``verl.optim.lr_scheduler_type``) whenever it is not built ``forward_only`` (refused by :func:`config_reasons`),
    and the capture records its state; a replay would find one in the rebuilt engine and refuse only then."""
    if not isinstance(state, dict) or state.get("lr_scheduler", ...) is not None:
        return []  # a scheduler state, or no key (refused by position_reasons)
    engine, optim = _table(_table(recorded).get("engine")), _table(_table(recorded).get("optim"))
    if engine.get("forward_only"):
        return []  # no optimizer, no scheduler: the engine itself is refused
    return [f"framework_state.lr_scheduler is null, but the recorded engine builds an LR scheduler (verl.optim."
            f"lr_scheduler_type {optim.get('lr_scheduler_type')!r:.24}) with its optimizer, whose state a capture "
            "records; the capture contradicts itself (recapture the step)"]


# -- replay -----------------------------------------------------------------------------------------

def _build(cls: Any, values: dict[str, Any], extra: dict[str, Any]) -> Any:
    """``cls(**values)`` with each nested dataclass field (``policy_loss``, ``qat``, ``mtp``, ...) built from its
    recorded object the same way, a recorded list given back as the tuple a tuple default is, and ``extra``
    passed as it is."""
    kwargs: dict[str, Any] = dict(extra)
    for f in dataclasses.fields(cls):
        if f.name in extra or f.name not in values or not f.init:
            continue
        v = values[f.name]
        factory = f.default_factory
        if isinstance(v, dict) and isinstance(factory, type) and dataclasses.is_dataclass(factory):
            v = _build(factory, v, {})
        elif isinstance(v, list) and isinstance(f.default, tuple):
            v = tuple(v)
        kwargs[f.name] = v
    return cls(**kwargs)


def _section(section: str, cls: Any, values: dict[str, Any], **extra: Any) -> Any:
    """verl's config dataclass of one section built from its recorded values, then checked field by field against
    them, so the engine runs with exactly the resolved values."""
    built = _build(cls, values, extra)
    for name, want in values.items():
        if name not in extra and jsonable(getattr(built, name)) != want:
            raise ContractError(f"verl.{section}.{name} builds as {jsonable(getattr(built, name))!r}, the resolved "
                                f"config says {want!r}", where=f"verl.{section}.{name}")
    return built


def build_engine(values: dict[str, Any], model_path: Path) -> tuple[Any, Any]:
    """verl's engine and loss from the resolved ``verl`` config sections and the base model directory, as the
    ``ActorRolloutRefWorker`` builds them for the actor (no Ray, no rollout)."""
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.utils import losses

    engine_values = dict(values["engine"])
    model = _section("model", HFModelConfig, values["model"], path=str(model_path), load_tokenizer=False)
    optim = _section("optim", FSDPOptimizerConfig, values["optim"])
    engine_cfg = _section("engine", FSDPEngineConfig, engine_values)
    actor = _section("actor", FSDPActorConfig, values["actor"], rollout_n=1, optim=optim, fsdp_config=engine_cfg,
                     use_dynamic_bsz=engine_values["use_dynamic_bsz"],
                     ppo_micro_batch_size_per_gpu=engine_values["micro_batch_size_per_gpu"],
                     ppo_max_token_len_per_gpu=engine_values["max_token_len_per_gpu"] or 16384)
    actor.model_config = model
    engine = EngineRegistry.new(model_type="language_model", backend=engine_cfg.strategy, model_config=model,
                                engine_config=engine_cfg, optimizer_config=optim, checkpoint_config=actor.checkpoint)
    engine.initialize()
    return engine, functools.partial(getattr(losses, values["loss"]), config=actor)


class VerlSession(ReplaySession):
    """verl's engine rebuilt from a verified capture, running the captured optimizer step."""

    trace_refusal: str | None = None

    def __init__(self, adm: Admission, out: Path):
        import torch

        assert adm.resolved is not None and adm.manifest is not None
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cpu":
            use_cpu()
        import torch.distributed as dist

        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if self.world > 1:
            self.repeat_refusal = f"it runs on {self.world} processes"
        values = adm.resolved[FRAMEWORK]
        self.engine_values = values["engine"]
        self.trace_refusal = trace_refusal(self.engine_values, self.world)
        self.engine, self.loss_fn = build_engine(values, Path(adm.resolved["model"]["path"]))
        self.model = self.engine.module
        self.optimizer = self.engine.optimizer
        self.scheduler = self.engine.lr_scheduler
        self._mode: contextlib.ExitStack | None = None
        self._update_lr = False
        # what the engine ran, for the knobs' observation: the rows of each micro-batch its forward_step received
        self.micro_rows: list[int] = []
        self.batch_settings: dict[str, Any] = {}
        forward = self.engine.forward_step

        def forward_step(micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
            self.micro_rows.append(int(micro_batch.batch_size[0]))
            return forward(micro_batch, loss_function=loss_function, forward_only=forward_only)

        self.engine.forward_step = forward_step

    @property
    def observed(self) -> dict[str, Any]:
        """The engine settings in effect, as the last update ran them (read by the verl knobs' observers): each as
        the batch the engine's ``forward_backward_batch`` received carried it, and the micro-batch size, where the
        engine splits by row count, as the largest micro-batch its ``forward_step`` received."""
        seen = dict(self.batch_settings)
        seen["model.use_remove_padding"] = bool(self.engine.use_remove_padding)  # as the engine built the model
        seen.update(built_precision(self.engine))
        if not seen.get("use_dynamic_bsz") and self.micro_rows:
            seen["micro_batch_size_per_gpu"] = max(self.micro_rows)
        return seen

    def observe(self, rows: tuple[int, ...]) -> knobs.Runtime:
        return knobs.Runtime(self.model, rows, trainer=self)

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The trainable parameters as a traced replay reads them (one process): their values and gradients as full
        tensors, their hooks on the engine's own parameters."""
        views: list[Any] = [(name, FullView(p)) for name, p in self.model.named_parameters() if p.requires_grad]
        return views

    def plan(self) -> list[MicroStep]:
        """The captured step as one micro-step per micro-batch the engine will run (where a traced replay can key
        rows: on one process, padded or packed), else one per captured call.  The first runs the whole captured
        ``train_batch`` (the engine splits it itself, as it did at capture); the others only mark where the engine's
        next forward begins, with the rows and padded ``input_ids`` it receives."""
        refusal = self.trace_refusal
        steps = super().plan()  # it names no input_ids for the captured call (trace_inputs): decided here instead
        self.trace_refusal = refusal
        if refusal is not None:
            return steps
        out: list[MicroStep] = []
        for step in steps:
            mb: _microbatch.MicroBatch = step.data
            first = min(step.rows)
            for j, (rows, ids, mask, offsets) in enumerate(engine_micro_batches(self.engine, mb, self.engine_values)):
                out.append(MicroStep(tuple(first + r for r in rows), step.rng if j == 0 else None,
                                     mb if j == 0 else None, ids, mask, offsets))
        return out

    def micro_batch(self, i: int, step: MicroStep, before_loss: Any) -> None:
        if step.data is not None:  # the captured call; the engine runs every micro-batch of it
            super().micro_batch(i, step, before_loss)

    @property
    def captured_processes(self) -> int:
        return len(self.adm.rank_micro_batches) if self.adm.rank_micro_batches is not None else 1

    def regroup(self, mbs: list[_microbatch.MicroBatch]) -> list[_microbatch.MicroBatch]:
        """This process's share of the captured step: on as many processes as the capture, its own captured share
        (each process captured its own, in rank order); on another count (``distributed.num_processes``, checked at
        admission), its contiguous share of the rows of the shares joined (:func:`regrouped`)."""
        if self.world == self.captured_processes:
            if self.world == 1:
                return mbs
            per = len(mbs) // self.world
            return mbs[self.rank * per:(self.rank + 1) * per]
        return [regrouped(mbs, self.rank, self.world)]

    def rows_of(self, mbs: list[_microbatch.MicroBatch]) -> int:
        """The rows of verl's batches: their ``batch_size`` (a whole-batch tensor, the unpad ``indices``, is no
        row count)."""
        return sum(_rows(mb) for mb in mbs)

    def shard_begin(self, every: list[_microbatch.MicroBatch], mine: list[_microbatch.MicroBatch]) -> int:
        """The first row of this process's share: the rows of the shares before it (equal shares)."""
        return self.rank * self.rows_of(mine)

    def reported_loss(self, summed: float) -> float:
        return reported_loss([summed], self.world)

    def trace_inputs(self, mb: _microbatch.MicroBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return None, None

    def restore(self) -> None:
        restore_state(self.adm, self)

    def run(self, mb: _microbatch.MicroBatch, inputs: dict[str, Any], call: dict[str, Any],
            before_loss: Any) -> float:
        import torch
        from verl.utils import tensordict_utils as tu
        from verl.utils.tensordict_utils import maybe_fix_3d_position_ids

        data = decode_batch(inputs, self.engine_values)
        self.batch_settings = {field: tu.get_non_tensor_data(data, key, None) for key, field in ENGINE_KEYS.items()}
        self._update_lr = bool(inputs["batch"]["non_tensor"].get("update_lr_scheduler", False))
        if self._mode is None:
            self._mode = contextlib.ExitStack()
            self._mode.enter_context(self.engine.train_mode(disable_auto_offload=bool(
                inputs["batch"]["non_tensor"].get("disable_auto_offload", False))))
        maybe_fix_3d_position_ids(data)
        self.micro_rows = []
        self.engine.optimizer_zero_grad()
        before_loss()
        out = self.engine.forward_backward_batch(data, self.loss_fn, forward_only=False)
        return float(torch.sum(torch.tensor(out["loss"])))

    def optimizer_step(self) -> float:
        try:
            grad_norm = float(self.engine.optimizer_step())
        finally:
            if self._mode is not None:
                self._mode.close()
                self._mode = None
        if self._update_lr:
            self.engine.lr_scheduler_step()
        return grad_norm

    def save_adapter(self, out: Path) -> Path | None:
        params = dict(FullParameters(self.model).named_parameters())  # gathered on every process (a collective)
        if self.rank != 0:
            return None
        path = out / _files.FINAL_ADAPTER_FILE
        atomic_write_bytes(path, adapter_bytes(params), exclusive=True)  # the bytes _files.save_adapter writes
        return path


def built_precision(engine: Any) -> dict[str, str | None]:
    """The dtypes verl's engine was built with, named as verl names them: the parameters' compute dtype and the
    gradients' reduce dtype of the root module's FSDP2 policy, the parameter dtype only where verl's autocast
    dtype agrees with it (``None`` where the engine reports neither)."""
    from verl.utils.torch_dtypes import PrecisionType

    state = getattr(engine.module, "_get_fsdp_state", None)
    policy = getattr(state(), "_mp_policy", None) if callable(state) else None
    param, reduce = getattr(policy, "param_dtype", None), getattr(policy, "reduce_dtype", None)
    autocast = getattr(engine, "_autocast_dtype", None)
    return {"mixed_precision.param_dtype": PrecisionType.to_str(param) if param is not None and param == autocast
            else None,
            "mixed_precision.reduce_dtype": PrecisionType.to_str(reduce) if reduce is not None else None}


def trace_refusal(engine: dict[str, Any], world: int) -> str | None:
    """Why a traced replay of this engine configuration cannot key its records by logical row (``None``: it can)."""
    if world > 1:
        return f"it runs on {world} processes (trace a one-process capture)"
    return None


def engine_micro_batches(engine: Any, mb: _microbatch.MicroBatch, values: dict[str, Any]) -> Iterator[
        tuple[list[int], Any, Any, Any]]:
    """The micro-batches verl's engine splits the captured batch into (its own ``prepare_micro_batches``, as
    ``forward_backward_batch`` calls it), each as its rows within the batch, the ``input_ids`` the model receives,
    the mask of real tokens, and where each row's tokens lie when they are packed.

    Padded (remove-padding off): ``[rows, width]``, each row's tokens then the pad token id; offsets ``None``.
    Packed (remove-padding on): ``[1, tokens]``, the rows' tokens one after the other as the engine's
    ``prepare_model_inputs`` builds them (right-padded to its bucket when it has one), and the row offsets
    (the jagged ``input_ids``' own)."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import pad_packed_inputs, prepare_micro_batches

    data = decode_batch({**mb.inputs, **mb.input_values}, values)
    tu.assign_non_tensor(data, sp_size=engine.ulysses_sequence_parallel_size)
    micro, indices = prepare_micro_batches(data=data, dp_group=engine.get_data_parallel_group(),
                                           same_micro_num_in_dp=True)
    start = 0
    for j, part in enumerate(micro):
        n = int(part.batch_size[0])
        rows = list(indices[j]) if indices is not None else list(range(start, start + n))
        start += n
        ids = part["input_ids"]
        lengths = ids.offsets().diff()
        if tu.get_non_tensor_data(data=part, key="use_remove_padding", default=True):
            packed = ids.values().unsqueeze(0)
            packed, _ = pad_packed_inputs(packed, None, engine._get_packed_pad_size(packed.size(-1)))
            mask = torch.zeros_like(packed, dtype=torch.int64)
            mask[0, :int(lengths.sum())] = 1
            yield rows, packed, mask, ids.offsets().to(torch.int64)
            continue
        width = int(lengths.max())
        pad = tu.get_non_tensor_data(data=part, key="pad_token_id", default=0)
        padded = torch.nested.to_padded_tensor(ids, padding=pad, output_size=(n, width))
        yield rows, padded, (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.int64), None


class FullView:
    """An engine parameter as the trace recorder reads it on one process: its value and gradient as full tensors
    (gathered from FSDP2's DTensor, which holds the whole tensor on one process), hooks placed on the parameter."""

    def __init__(self, param: Any):
        self.param = param

    @property
    def grad(self) -> Any:
        return None if self.param.grad is None else full(self.param.grad)

    def detach(self) -> Any:
        return full(self.param.detach())

    def register_post_accumulate_grad_hook(self, hook: Any) -> Any:
        return self.param.register_post_accumulate_grad_hook(lambda _p: hook(self))


def restore_state(adm: Admission, session: VerlSession) -> None:
    """Copy the captured trainable parameters into the engine's (sharded) parameters, re-hash them, and load the
    optimizer state (sharded like its parameters) and the LR-scheduler state."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    m = adm.manifest
    assert m is not None and adm.adapter is not None and adm.optimizer is not None
    params = {n: p for n, p in session.model.named_parameters() if p.requires_grad}
    if list(params) != list(m.doc["trainable"]):
        missing = sorted(set(m.doc["trainable"]) - set(params))
        extra = sorted(set(params) - set(m.doc["trainable"]))
        raise ContractError(f"the rebuilt engine's trainable parameters differ from the capture's (missing "
                            f"{missing[:3]}, extra {extra[:3]}, or another order)", where=m.file("adapter"))

    def placed(t: torch.Tensor, like: Any) -> Any:
        if isinstance(like, DTensor):
            return distribute_tensor(t.to(like.device), like.device_mesh, like.placements)
        return t.to(like.device)

    with torch.no_grad():
        for name, p in params.items():
            t = adm.adapter[name]
            if tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
                raise ContractError(f"captured parameter {name} is {t.dtype}{list(t.shape)}, the engine's "
                                    f"{p.dtype}{list(p.shape)}", where=m.file("adapter"))
            p.copy_(placed(t, p))
    loaded = sha256_bytes(adapter_bytes(dict(FullParameters(session.model).named_parameters())))
    if loaded != m.initial_adapter_sha256:
        raise ContractError(f"the loaded parameters hash to {loaded}, the manifest pins {m.initial_adapter_sha256}",
                            where=m.file("adapter"))
    ordered = [p for g in session.optimizer.param_groups for p in g["params"]]
    doc = m.doc["optimizer"]
    # the full shapes on the host: each state tensor is placed like its parameter below
    host: Any = [SimpleNamespace(shape=tuple(p.shape), device=torch.device("cpu")) for p in ordered]
    state = join_optimizer_state(adm.optimizer, doc, host, m.file("optimizer"))
    for i, entry in state["state"].items():
        for key, t in list(entry.items()):
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                entry[key] = placed(t, ordered[i])
    try:  # torch's own checks of the groups against the rebuilt optimizer's: the capture's, not a failure
        session.optimizer.load_state_dict(state)
    except ValueError as exc:
        raise ContractError(f"the captured optimizer state does not fit the rebuilt engine's optimizer: "
                            f"{str(exc)[:200]} (optimizer.param_groups)", where=m.path,
                            hint="replay with the verl config the step ran with, or recapture the step") from None
    sched = m.doc["framework_state"].get("lr_scheduler")
    if (sched is None) != (session.scheduler is None):
        raise ContractError("the capture and the rebuilt engine disagree on whether there is an LR scheduler",
                            where=m.path)
    if sched is not None:
        session.scheduler.load_state_dict(copy.deepcopy(sched))


def framework_state_reasons(state: dict[str, Any], groups: list[Any], step: int, processes: int) -> list[str]:
    """Why the recorded ``framework_state`` is not what a verl capture of ``processes`` processes writes
    (:func:`position_reasons`), and why its ``lr_scheduler`` (loaded whole into the rebuilt engine's scheduler) is not
    a torch scheduler's state (:func:`replayjob.rl.state.scheduler_type_reasons`): typed counters, one base learning
    rate and lr_lambda per param group, no key naming its optimizer or a method."""
    why = position_reasons(state, step, processes)
    sched = state.get("lr_scheduler")
    if sched is None:
        return why
    if not isinstance(sched, dict):
        return [*why, f"framework_state.lr_scheduler is {str(sched)[:24]}, not a scheduler state (an object) or "
                      "null"]
    return why + scheduler_type_reasons(groups, sched, "framework_state.lr_scheduler")


STATE_KEYS = ("lr_scheduler", "optimizer_step", "position", "world_size")
POSITION_KEYS = ("epoch", "epochs", "mini_batch", "mini_batches_per_epoch", "update")


def _count(v: Any, least: int) -> bool:
    return type(v) is int and least <= v < 2**63


def position_reasons(state: dict[str, Any], step: int, processes: int) -> list[str]:
    """Why the rest of a verl capture's ``framework_state`` is not what the capture writes (``_open``): exactly its
    keys, ``optimizer_step`` the manifest's step, ``world_size`` the processes that ran the captured step (the
    manifest's: one, or its root's ranks), and ``position`` (which update, epoch and mini-batch the step was) counts
    of the types and ranges the capture counts them in."""
    why = [f"framework_state.{k} is no key a verl capture writes (it writes {', '.join(STATE_KEYS)})"
           for k in sorted(set(state) - set(STATE_KEYS))]
    why += [f"framework_state.{k} is missing" for k in STATE_KEYS if k not in state]
    if "optimizer_step" in state and not (type(state["optimizer_step"]) is int and state["optimizer_step"] == step):
        why.append(f"framework_state.optimizer_step is {state['optimizer_step']!r:.24}, not the captured step "
                   f"{step}")
    if "world_size" in state and not (type(state["world_size"]) is int and state["world_size"] == processes):
        why.append(f"framework_state.world_size is {state['world_size']!r:.24}, but the captured step ran on "
                   f"{processes} process{'es' if processes != 1 else ''} (the manifest's)")
    pos = state.get("position", {})
    if not isinstance(pos, dict) or sorted(pos) != sorted(POSITION_KEYS):
        return [*why, f"framework_state.position is {pos!r:.60}, not a table of {', '.join(POSITION_KEYS)}"]
    least = {"update": -1, "epochs": 1, "mini_batches_per_epoch": 1}
    why += [f"framework_state.position.{k} is {v!r:.24}, not an integer >= {least.get(k, 0)}"
            for k, v in sorted(pos.items()) if not _count(v, least.get(k, 0))]
    if not why and pos["mini_batch"] >= pos["mini_batches_per_epoch"]:
        why.append(f"framework_state.position.mini_batch {pos['mini_batch']} is not below its mini_batches_per_epoch "
                   f"{pos['mini_batches_per_epoch']}")
    return why


def build_replay(adm: Admission, out: Path) -> VerlSession:
    """The producer registry's entry point."""
    return VerlSession(adm, out)
