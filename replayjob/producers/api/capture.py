"""The public capture API: hand replayjob the batch any PyTorch optimizer step consumes.

A loop (or a framework integration such as :mod:`replayjob.producers.trl.producer`) drives one
:class:`StepCapture` through the step it wants to replay::

    cap = StepCapture(out_dir, step=K, framework="torch", model=model, optimizer=opt, scheduler=sched,
                      base_model_dir=base_dir, config={"torch": cfg, "model": {"path": base_dir}},
                      entry="my_loop.py:replay_target")
    cap.begin()                                   # before the first micro-batch of step K
    for inputs in micro_batches:
        cap.record(inputs)                        # right before the loss call: inputs + Torch RNG
        loss = loss_fn(model, inputs); loss.backward(); cap.add_loss(float(loss))
    g = optimizer_step(model, opt, sched, max_grad_norm)   # clip, step, schedule, zero_grad
    result = cap.finish(grad_norm=g)              # after the update: files, manifest last, metrics, replay.toml

What is recorded: every input of every micro-batch in its own dtype (tensors as safetensors,
JSON-representable values in the manifest), the Torch CPU/CUDA RNG state right before each loss
call, the trainable (adapter) parameters and the full optimizer and LR-scheduler state just
before the step, the base model's identity (config and SHA-256 of its safetensors weights; a
local directory only), the redacted config and contract, and the adapter after the real update.

File discipline: everything is held in memory until :meth:`StepCapture.finish`, which writes the
safetensors files, then the manifest (exclusively, last), then ``final_adapter/``, ``metrics.json``
and a ready ``replay.toml`` with the pins filled in.  A step that never finishes writes nothing.

Several steps of one run: :class:`ChosenSteps` hands out one :class:`StepCapture` per chosen step
(each writes its files and ``replay_step_<K:06d>.toml``) and, at :meth:`ChosenSteps.close`, writes
``metrics.json`` once with every captured step's pins (the ``optimizer_batch/steps`` record).
"""

from __future__ import annotations

import math
import platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import replayjob
from replayjob.artifacts import api_manifest as imanifest
from replayjob.artifacts import metrics as metrics_io
from replayjob.artifacts.capture_manifest import outcome, replay_config_name
from replayjob.config import redact
from replayjob.config.dump import replay_pins, section, toml_value
from replayjob.digest import sha256_bytes
from replayjob.errors import CaptureError
from replayjob.fsio import atomic_write_bytes, atomic_write_text
from replayjob.producers import EXTERNAL, producer_module
from replayjob.producers.api.files import (
    FINAL_ADAPTER_FILE,
    METRICS_FILE,
    REPLAY_CONFIG,
    STACK,
    adapter_file_bytes,
    base_model_identity,
    capture_config,
    capture_file_names,
    chosen_steps,
    entry_identity,
    refuse_existing,
    save_adapter,
    trainable_parameters,
)
from replayjob.producers.api.microbatch import (
    MicroBatch,
    captured_json,
    effective_digest,
    has_nonfinite,
    logical_digest,
    rows_summary,
    split_group,
)
from replayjob.rl.state import (
    adapter_bytes,
    optimizer_bytes_of,
    rng_tensors,
    safetensors_bytes,
    split_optimizer_state,
)
from replayjob.runtime import determinism, knobs

if TYPE_CHECKING:
    import torch

#: the capture API (what a user's loop imports); the pieces it is made of are internals
#: (:mod:`replayjob.producers.api.microbatch`, :mod:`replayjob.producers.api.files`)
__all__ = ["CaptureError", "CaptureResult", "ChosenSteps", "StepCapture", "StepsResult"]


# -- the capture ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CaptureResult:
    """Where a finished capture wrote its files and the pins a replay needs."""

    out_dir: Path
    manifest: Path
    manifest_sha256: str
    logical_sha256: str
    replay_toml: Path
    metrics: dict[str, Any]


def default_stack(framework: str) -> tuple[str, ...]:
    """The packages whose installed versions a capture records (``stack.<package>``, a difference admitted for the
    approximate claim only): TRL's whole stack for ``trl``; for another producer (a plain loop) torch and whichever
    of the others its process has imported, so a capture names only what the loop can have run."""
    import sys

    if framework == "trl":
        return STACK
    return ("torch", *(p for p in STACK if p != "torch" and p in sys.modules))


def knob_hint(framework: str) -> list[str]:
    """The replay config's comment lines on systems-only differences: the producer's own knobs, or that it has
    none (a plain loop's whole config is the contract)."""
    names = sorted(knobs.knobs_for(framework))
    if not names:
        return [f"# Framework {framework!r} has no systems-only knobs: its whole config is the contract, so every",
                "# replay runs the captured update (compare repeats with `replayjob reduce`; a changed library",
                "# version is a declared stack.<package> difference, admitted for the approximate claim only)."]
    return [f"# A systems-only difference: --set KEY=VALUE for one of {', '.join(names)},",
            "# declared in optimizer_batch.allow_config_differences (docs/capture-api.md lists what each holds for)."]


class StepCapture:
    """Capture one optimizer step of any PyTorch training loop (see the module docstring).

    Args:
        out_dir: where the files go; a manifest already there for this step is refused.
        step: the 0-based optimizer step being captured (recorded; the caller decides when).
        framework: a key of :data:`replayjob.producers.EXTERNAL` (which module replays it).
        model, optimizer, scheduler: the live objects; trainable parameters are those with
            ``requires_grad``, in the order the optimizer holds them.
        base_model_dir: the local directory the base model was loaded from.
        config: the resolved config (``{<framework>: ..., "model": {"path": ...}, ...}``); redacted
            here, with the installed ``stack`` versions added.  The contract is derived from it by
            the framework module's ``contract()``, the function admission applies to the replay.
        framework_state: JSON the framework needs to stand its trainer at this step.
        entry: framework ``"torch"``: the replay target ``FILE.py:function`` (see
            :mod:`replayjob.producers.torch_loop`); its file is pinned by SHA-256.
        several: one of several chosen steps (:class:`ChosenSteps` sets it): ``finish`` writes
            ``replay_step_<K:06d>.toml`` and neither ``final_adapter/`` nor ``metrics.json``; its
            result's ``metrics`` is the step's entry for the shared metrics.json.
        base_model: the identity :func:`base_model_identity` already computed for ``base_model_dir``
            (several steps hash the base model once).
        part: one process's part of a capture over several processes
            (:mod:`replayjob.producers.api.parts`): ``finish`` writes the payload, adapter, optimizer
            files and the manifest only; the root manifest, ``final_adapter/``, ``metrics.json`` and
            ``replay.toml`` are written once, by the first process, next to the process directories.
    """

    def __init__(self, out_dir: str | Path, *, step: int, framework: str, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any, base_model_dir: str | Path,
                 config: dict[str, Any], framework_state: dict[str, Any] | None = None,
                 stack: Iterable[str] | None = None, entry: str = "", several: bool = False,
                 base_model: dict[str, Any] | None = None,
                 part: bool = False):
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CaptureError(f"step must be an integer >= 0, found {step!r}", where="step")
        if framework not in EXTERNAL:
            raise CaptureError(f"unknown framework {framework!r}", where="framework",
                               hint="one of: " + ", ".join(sorted(EXTERNAL)))
        self.out_dir = Path(out_dir)
        self.names = imanifest.file_names(step)
        refuse_existing(self.out_dir, list(imanifest.file_names(step).values()) if part
                        else capture_file_names(step, several=several))
        self.part = part
        self.several = several
        self.replay_name = replay_config_name(step) if several else REPLAY_CONFIG
        self.step, self.framework = step, framework
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        if not trainable_parameters(model):
            raise CaptureError("the model has no trainable parameters", where="model")
        # hashed now: refused before any training
        self.base_model = base_model if base_model is not None else base_model_identity(base_model_dir)
        self.base_model_dir = Path(base_model_dir).resolve()  # the replay config names it as it is
        self.config = capture_config(config, default_stack(framework) if stack is None else stack)

        # the framework module's own contract function, the one admission applies to the replay's config
        self.contract: dict[str, Any] = redact(producer_module(framework).contract(self.config))
        state = dict(framework_state or {})
        self.entry = ""
        if entry:  # a plain loop's replay target (FILE.py:function), pinned by the file's SHA-256
            state["entry"] = ident = entry_identity(entry)
            self.entry = f"{ident['file']}:{ident['function']}"
        self.framework_state = captured_json(state, "framework_state")
        self.micro_batches: list[MicroBatch] = []
        self.loss = 0.0
        self._adapter: dict[str, torch.Tensor] | None = None
        self._optimizer: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
        self.result: CaptureResult | None = None

    @property
    def active(self) -> bool:
        """Between :meth:`begin` and :meth:`finish`."""
        return self._adapter is not None and self.result is None

    def begin(self) -> None:
        """Snapshot the trainable parameters and the optimizer and scheduler state (before the step)."""
        self._adapter = {n: p.detach().to("cpu", copy=True) for n, p in trainable_parameters(self.model).items()}
        tensors, doc = split_optimizer_state(self.optimizer.state_dict())
        sched = self.scheduler.state_dict() if self.scheduler is not None else None
        doc["scheduler"] = captured_json(sched, "scheduler state") if sched is not None else None
        self._optimizer = (tensors, doc)

    def record(self, inputs: Mapping[str, Any], call: Mapping[str, Any] | None = None, *,
               sync_gradients: bool = True, accumulation_steps: int = 1) -> None:
        """Record one loss call's inputs (and keyword arguments) with the Torch RNG state right now.

        Call it immediately before the loss function; reading the RNG state consumes no random numbers.
        """
        if not self.active:
            raise CaptureError("record() outside begin() ... finish()", where="StepCapture.record")
        i = len(self.micro_batches)
        ins, in_vals = split_group(inputs, f"micro-batch {i} inputs")
        kw, kw_vals = split_group(call or {}, f"micro-batch {i} call")
        rng = {k: t.clone() for k, t in rng_tensors().items()}
        self.micro_batches.append(MicroBatch(ins, in_vals, kw, kw_vals, rng, bool(sync_gradients),
                                             int(accumulation_steps)))

    def note(self, key: str, value: Any) -> None:
        """Add ``key`` to the step's ``framework_state`` (a fact observed during the step, such as the precision
        its forward ran in); refused outside begin() ... finish()."""
        if not self.active:
            raise CaptureError("note() outside begin() ... finish()", where="StepCapture.note")
        self.framework_state[key] = captured_json(value, f"framework_state.{key}")

    def add_loss(self, value: float) -> None:
        """Add one micro-batch's reported loss to the step's loss (in the order the loop sums it)."""
        self.loss += float(value)

    def abandon(self) -> None:
        """Drop everything recorded; nothing was written."""
        self._adapter, self._optimizer, self.micro_batches = None, None, []

    def finish(self, *, grad_norm: float | None = None) -> CaptureResult:
        """After the real update: write payload, adapter and optimizer files, the manifest (last),
        the final adapter, metrics.json and replay.toml (one of several steps: its replay_step_<K>.toml,
        the final adapter only hashed); return the pins."""
        if not self.active or self._optimizer is None or self._adapter is None:
            raise CaptureError("finish() without begin()", where="StepCapture.finish")
        if not self.micro_batches:
            raise CaptureError(f"no micro-batch was recorded at step {self.step}", where="StepCapture.finish",
                               hint="call record() right before each loss call of the step")
        finite = math.isfinite(self.loss) and (grad_norm is None or math.isfinite(float(grad_norm)))
        if not finite and not self.several:
            raise CaptureError(f"step {self.step}'s loss or gradient norm is not finite (loss {self.loss!r}, grad "
                               f"norm {grad_norm!r}); a one-step capture's metrics.json records finite values",
                               where="StepCapture.finish",
                               hint="capture it as one of several steps (steps=[...]): that record leaves a "
                                    "non-finite loss or gradient norm null")
        out, names = self.out_dir, self.names
        trainable = list(self._adapter)
        payload: dict[str, torch.Tensor] = {}
        for i, mb in enumerate(self.micro_batches):
            payload.update(mb.payload(i))
        opt_tensors, opt_doc = self._optimizer
        files: dict[str, dict[str, Any]] = {}
        # one serialisation of adapter and optimizer state for every producer (replayjob.rl.state)
        for role, data in (("payload", safetensors_bytes(payload, "replayjob-payload")),
                           ("adapter", adapter_bytes(self._adapter)), ("optimizer", optimizer_bytes_of(opt_tensors))):
            atomic_write_bytes(out / names[role], data, exclusive=True)
            files[role] = {"file": names[role], "size": len(data), "sha256": sha256_bytes(data)}
        logical = logical_digest(self.micro_batches)
        effective = effective_digest(self.micro_batches)
        # the manifest's rows: sizes, and whether a float input holds NaN/Inf (replayed only when opted in)
        rows: dict[str, int | bool] = {**rows_summary(self.micro_batches),
                                       "nonfinite_inputs": has_nonfinite(self.micro_batches)}
        loss = metrics_io.finite_or_none(self.loss)
        grad = metrics_io.finite_or_none(None if grad_norm is None else float(grad_norm))
        final_sha = sha256_bytes(adapter_file_bytes(self.model))  # the adapter after the real update
        doc = imanifest.build(
            framework=self.framework, step=self.step,
            producer={"replayjob": replayjob.__version__, "python": platform.python_version(),
                      "device": str(next(iter(trainable_parameters(self.model).values())).device),
                      "versions": self.config["stack"], "determinism": determinism.snapshot()},
            files=files, micro_batches=[m.entry() for m in self.micro_batches], optimizer=opt_doc,
            trainable=trainable, framework_state=self.framework_state, rows=rows, logical=logical,
            effective=effective, config=self.config, contract=self.contract, base_model=self.base_model,
            # sealed: the numbers metrics.json (or the step record) reports, pinned with this manifest
            sealed=outcome(loss, grad, final_sha))
        manifest_path = out / names["manifest"]
        manifest_sha = imanifest.write(manifest_path, doc)
        if self.part:  # one process's part of a capture over several: the root writes the rest
            self.result = CaptureResult(out, manifest_path, manifest_sha, logical, out.parent / REPLAY_CONFIG, {})
            return self.result
        metrics: dict[str, Any]
        if self.several:  # the adapter after the real update, hashed in the bytes save_adapter writes
            metrics = metrics_io.step_record(
                step=self.step, manifest_path=names["manifest"], manifest_sha256=manifest_sha, logical=logical,
                effective=effective, initial_adapter_sha256=files["adapter"]["sha256"], final_adapter_sha256=final_sha,
                replay_config=self.replay_name, nonfinite_inputs=bool(rows["nonfinite_inputs"]), loss=loss,
                grad_norm=grad)
        else:
            if save_adapter(out / FINAL_ADAPTER_FILE, self.model) != final_sha:
                raise CaptureError("the final adapter file's SHA-256 is not the one sealed in the manifest",
                                   where=out / FINAL_ADAPTER_FILE, hint="the model changed during finish(); "
                                                                        "report it as a bug")
            metrics = metrics_io.capture_document(
                framework=self.framework, step=self.step, logical=logical, effective=effective,
                manifest_sha256=manifest_sha, manifest_path=names["manifest"],
                initial_adapter_sha256=files["adapter"]["sha256"], final_adapter_sha256=final_sha,
                final_adapter_path=FINAL_ADAPTER_FILE, loss=loss, grad_norm=grad, config=self.config)
            metrics_io.write(out / METRICS_FILE, metrics, exclusive=True)
        replay_toml = out / self.replay_name
        atomic_write_text(replay_toml, self._replay_toml(manifest_path.resolve(), manifest_sha, logical),
                          exclusive=True)
        self.result = CaptureResult(out, manifest_path, manifest_sha, logical, replay_toml, metrics)
        return self.result

    def _replay_toml(self, manifest: Path, manifest_sha: str, logical: str) -> str:
        return "\n".join([
            f"# Replay of optimizer step {self.step} captured from {self.framework}.",
            "# `replayjob explain` checks it without a model; `replayjob replay --out DIR` runs one update.",
            *knob_hint(self.framework),
            "[integration]", f"framework = {toml_value(self.framework)}",
            *([f"entry = {toml_value(self.entry)}"] if self.entry else []), "",
            "[model]", f"path = {toml_value(str(self.base_model_dir))}", "",
            "[optimizer_batch]", *(f"{k} = {toml_value(v)}" for k, v in
                                   section(replay_pins(manifest, logical, manifest_sha), "optimizer_batch").items()),
            "allow_config_differences = []", 'arm = ""', "",
        ])


# -- several chosen steps ---------------------------------------------------------------------------

@dataclass(frozen=True)
class StepsResult:
    """What a capture of several chosen steps wrote: each captured step's result, the steps training
    never completed, and the shared ``metrics.json`` (``None`` when no step was captured)."""

    out_dir: Path
    captured: dict[int, CaptureResult]
    not_captured: tuple[int, ...]
    metrics_path: Path | None

    def step(self, k: int) -> CaptureResult:
        """Step ``k``'s result; refused for a step that was not chosen or not captured."""
        if k not in self.captured:
            why = "training ended before it completed" if k in self.not_captured else "it was not chosen"
            raise CaptureError(f"optimizer step {k} was not captured ({why})", where=str(self.out_dir),
                               hint="train long enough to complete every chosen step" if k in self.not_captured
                               else f"captured steps: {sorted(self.captured)}")
        return self.captured[k]


class ChosenSteps:
    """Capture several chosen steps of one run into one directory (see ``docs/capture-api.md``).

    Per step ``K``: ``optimizer_batch_step_<K:06d>.{safetensors,adapter.safetensors,optimizer.safetensors,
    manifest.json}`` and ``replay_step_<K:06d>.toml``; after the run, :meth:`close` writes
    ``metrics.json`` once (last) with each captured step's pins under ``optimizer_batch/steps``
    (the record the built-in trainer's ``capture_steps`` writes, read by
    :func:`~replayjob.artifacts.metrics.read_steps`), including the SHA-256 of the adapter after the real
    update.  Refused at once: invalid steps and any
    file of a chosen step (or metrics.json) already in ``out_dir``; the base model is hashed here, once.
    """

    def __init__(self, out_dir: str | Path, *, steps: Iterable[int], framework: str, base_model_dir: str | Path,
                 config: dict[str, Any], stack: Iterable[str] | None = None, entry: str = ""):
        self.out_dir = Path(out_dir)
        self.steps = chosen_steps(steps)
        refuse_existing(self.out_dir, [METRICS_FILE, *(n for k in self.steps
                                                       for n in capture_file_names(k, several=True))])
        self.framework, self.base_model_dir, self.entry = framework, base_model_dir, entry
        self._config, self._stack = config, tuple(default_stack(framework) if stack is None else stack)
        self.base_model = base_model_identity(base_model_dir)
        self.captures: dict[int, StepCapture] = {}
        self.result: StepsResult | None = None

    def at(self, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
           framework_state: dict[str, Any] | None = None) -> StepCapture | None:
        """The :class:`StepCapture` of ``step`` when it is a chosen step not yet begun, else None.

        Call it at the start of each step (before ``begin()``), with the live objects of that step."""
        if step not in self.steps or step in self.captures or self.result is not None:
            return None
        c = StepCapture(self.out_dir, step=step, framework=self.framework, model=model, optimizer=optimizer,
                        scheduler=scheduler, base_model_dir=self.base_model_dir, config=self._config,
                        framework_state=framework_state, stack=self._stack, entry=self.entry, several=True,
                        base_model=self.base_model)
        self.captures[step] = c
        return c

    def close(self) -> StepsResult:
        """After training: drop a step still open, write ``metrics.json`` (exclusively, last) with every
        finished step's pins, and return the result (idempotent).  Nothing is written when no step finished."""
        if self.result is not None:
            return self.result
        for c in self.captures.values():
            if c.active:
                c.abandon()
        done = {k: c.result for k, c in sorted(self.captures.items()) if c.result is not None}
        missing = tuple(k for k in self.steps if k not in done)
        path: Path | None = None
        if done:
            first = next(iter(self.captures.values()))
            path = self.out_dir / METRICS_FILE
            metrics_io.write(path, metrics_io.steps_document(
                framework=self.framework, steps=[r.metrics for r in done.values()], not_captured=list(missing),
                config=first.config), exclusive=True)
        self.result = StepsResult(self.out_dir, done, missing, path)
        return self.result
