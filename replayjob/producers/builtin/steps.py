"""Any step of a run, captured self-sufficiently: what chosen-step and ring-buffer capture share.

A capture of step ``K`` holds everything a replay of that one update needs, so no earlier step has
to be rerun: the rows and the Torch RNG state (the payload), and the state the update starts from
-- the adapter, the optimizer state (AdamW moments and step counts) and the learning rate -- as a
resume state of step ``K - 1``.  Files, for ``K = 3`` (all next to each other)::

    optimizer_batch_step_000003.state/          resume state of step 2 (rl/state.py layout):
        adapter_model.safetensors, optimizer.safetensors, trainer_state.json (last)
    optimizer_batch_step_000003.safetensors     payload: rows + RNG
    optimizer_batch_step_000003.manifest.json   pins all of it (its ``state`` section) and seals the real
                                                update's loss, gradient norm and final adapter (``outcome``,
                                                what the step record reports); written last
    replay_step_000003.toml                     a ready replay config with the pins filled in

On the training thread, :func:`take` only clones (rows, RNG, adapter, optimizer tensors) and
reads the learning rate; :func:`write` (the hook's background writer) encodes, hashes and writes,
every file atomically and exclusively (a capture is never overwritten).  The adapter file's bytes
are :func:`replayjob.rl.state.adapter_bytes`, the serialisation every adapter writer uses, so the
SHA-256 of the adapter after the real update (recorded by the source) is directly comparable with
a replay's ``final_adapter``.

A replay of such a capture (:func:`state_reasons` at admission, :func:`restore_optimizer` before
the update) starts from the pinned state: ``resume.from`` must be a state of step ``K - 1`` whose
adapter and optimizer files have the manifest's SHA-256; the learning rate must equal the
manifest's.  Rows holding NaN/Inf are flagged (``state.nonfinite_inputs``) and admitted only under
``optimizer_batch.allow_nonfinite_inputs = true``.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import replayjob
from replayjob.artifacts import capture_manifest as manifest
from replayjob.artifacts import capture_payload as payload
from replayjob.artifacts.metrics import (
    step_record,
)
from replayjob.config import Config, resolved
from replayjob.config.dump import dumps, replay_pins, section
from replayjob.config.load import to_dict
from replayjob.config.schema import OptimizerBatchConfig
from replayjob.digest import sha256_bytes
from replayjob.errors import ArtifactExistsError
from replayjob.fsio import atomic_write_bytes
from replayjob.producers.contract import optimizer_contract
from replayjob.rl.batch import OptimizerBatch
from replayjob.rl.hooks import TrainerView
from replayjob.rl.state import (
    ADAPTER_WEIGHTS,
    OPTIMIZER_FILE,
    ResumeState,
    adapter_bytes,
    load_optimizer,
    optimizer_bytes_of,
    optimizer_tensors,
    rng_tensors,
    write_state,
)
from replayjob.runtime import determinism

if TYPE_CHECKING:
    import torch
    from torch import Tensor


def state_dir_name(step: int) -> str:
    return manifest.state_dir_name(step)


def file_names(step: int) -> list[str]:
    """Every name a capture of ``step`` creates (none may exist beforehand)."""
    return [state_dir_name(step), manifest.payload_name(step), manifest.manifest_name(step),
            manifest.replay_config_name(step)]


def refuse_existing(out: Path, steps: list[int], what: str) -> None:
    """Refuse (before any work) when a capture of one of ``steps`` already exists in ``out``."""
    for step in steps:
        for name in file_names(step):
            if (out / name).exists():
                raise ArtifactExistsError(f"a {what} of step {step} already exists here and is never overwritten",
                                          where=out / name, hint="choose a new --out directory")


def producer(cfg: Config) -> dict[str, Any]:
    """Versions, device and the determinism provenance at the capture point (the manifest's ``producer``)."""
    import torch
    strict = cfg.backend.options.strict_deterministic
    prov = {"strict_deterministic": strict, "math_mode": determinism.math_mode_from_env(strict),
            "attn_implementation": cfg.backend.options.attn_implementation, **determinism.snapshot()}
    device = cfg.backend.torch_device
    out: dict[str, Any] = {"replayjob_version": replayjob.__version__, "torch_version": torch.__version__,
                           "python": platform.python_version(), "device": device, "provenance": prov}
    if device.startswith("cuda") and torch.cuda.is_available():
        out["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return out


def clone_rows(batch: OptimizerBatch) -> OptimizerBatch:
    return OptimizerBatch(**{k: v.detach().to("cpu", copy=True) for k, v in batch.tensors().items()})


@dataclass
class Packed:
    """Named tensors copied in one ``torch.cat`` per dtype (a clone per tensor costs about 20 us of
    Python each, and an adapter plus its optimizer state is dozens of tensors)."""

    flats: dict[torch.dtype, Tensor]
    index: list[tuple[str, torch.dtype, tuple[int, ...], int, int]]  # name, dtype, shape, begin, end
    _views: list[Tensor] | None = None  # per-name views of ``flats`` (built at the first refill)
    _sources: list[Tensor] | None = None  # the tensors the last refill copied

    @classmethod
    def of(cls, tensors: dict[str, Tensor]) -> Packed:
        import torch
        groups: dict[torch.dtype, list[tuple[str, Tensor]]] = {}
        for name, t in tensors.items():
            groups.setdefault(t.dtype, []).append((name, t.detach()))
        flats, index = {}, []
        for dtype, items in groups.items():
            flats[dtype] = torch.cat([t.reshape(-1) for _, t in items]).to("cpu")
            offset = 0
            for name, t in items:
                index.append((name, dtype, tuple(t.shape), offset, offset + t.numel()))
                offset += t.numel()
        return cls(flats, index)

    def refill(self, tensors: dict[str, Any]) -> bool:
        """Copy ``tensors`` into this pack's buffers in one call (no allocation); False (nothing copied)
        when their names, types, dtypes or shapes differ from the packed ones.  The same tensor objects
        as the last refill's (an optimizer updates its state in place) skip the comparison."""
        import torch
        from torch import Tensor
        sources = list(tensors.values())
        same = self._sources is not None and len(sources) == len(self._sources) and all(
            a is b for a, b in zip(sources, self._sources, strict=True))
        if not same and (len(tensors) != len(self.index) or any(
                not isinstance(t, Tensor) or t.dtype != dt or tuple(t.shape) != shape or name != n
                for (n, t), (name, dt, shape, _, _) in zip(tensors.items(), self.index, strict=True))):
            return False
        if self._views is None:
            self._views = [self.flats[dt][a:b].view(shape) for _, dt, shape, a, b in self.index]
        with torch.no_grad():
            torch._foreach_copy_(self._views, sources)
        self._sources = sources
        return True

    def unpack(self) -> dict[str, Tensor]:
        """Separate CPU tensors again (clones: nothing shares storage), in the packed names' order."""
        return {name: self.flats[dt][a:b].view(shape).clone() for name, dt, shape, a, b in self.index}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flats.values())


def clone_adapter(view: TrainerView) -> Packed:
    return Packed.of(view.adapter_state())


def live_optimizer_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's live state values under :func:`~replayjob.rl.state.optimizer_tensors`' names,
    untouched (no per-tensor calls: what a refill compares by identity and copies from)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    return {f"state.{i}.{k}": v for i, p in enumerate(params) for k, v in opt.state.get(p, {}).items()}


def has_nonfinite(rows: OptimizerBatch) -> bool:
    """True when a float row field holds NaN or Inf."""
    import torch
    return not all(bool(torch.isfinite(t).all()) for k, t in rows.tensors().items() if t.is_floating_point())


@dataclass
class StepSnapshot:
    """Everything a capture of one step needs, copied off the live training state."""

    step: int
    rows: OptimizerBatch
    rng: dict[str, Tensor]
    producer: dict[str, Any]
    adapter: Packed
    optimizer: Packed
    lr: list[float]
    final_adapter: Packed | None = None  # after the real update (the next step's start)
    loss: float | None = None  # the real update's loss and gradient norm, once it returned
    grad_norm: float | None = None

    def updated(self, result: Any) -> None:
        """Record the real update's loss and gradient norm (an :class:`~replayjob.rl.update.UpdateResult`)."""
        self.loss, self.grad_norm = float(result.loss), float(result.grad_norm)

    @property
    def nbytes(self) -> int:
        """Host memory the snapshot's tensors hold (a final adapter shared with the next snapshot counted here too)."""
        own = sum(t.numel() * t.element_size() for g in (self.rows.tensors(), self.rng) for t in g.values())
        return own + self.adapter.nbytes + self.optimizer.nbytes + (self.final_adapter.nbytes
                                                                     if self.final_adapter else 0)


def take(step: int, batch: OptimizerBatch, view: TrainerView, prod: dict[str, Any],
         reuse: StepSnapshot | None = None) -> StepSnapshot:
    """On the training thread, right before the update: copies only (into ``reuse``'s buffers when given
    and they fit, as a ring buffer recycles its oldest snapshot)."""
    rows = clone_rows(batch)
    adapter, opt = view.adapter_state(), view.optimizer
    if reuse is not None and reuse.adapter.refill(adapter) and reuse.optimizer.refill(live_optimizer_state(opt)):
        packed_adapter, packed_optimizer = reuse.adapter, reuse.optimizer
    else:
        packed_adapter, packed_optimizer = Packed.of(adapter), Packed.of(optimizer_tensors(opt))
    return StepSnapshot(step=step, rows=rows, rng=rng_tensors(), producer=prod, adapter=packed_adapter,
                        optimizer=packed_optimizer, lr=[float(g["lr"]) for g in view.optimizer.param_groups])


def write(out: Path, snap: StepSnapshot, cfg: Config, model_reference: dict[str, Any],
          relative_to: Path | None = None) -> dict[str, Any]:
    """On the writer thread: state, payload, manifest (last of the pinned files), replay config.

    Returns the step's pins for ``metrics.json`` (paths relative to ``relative_to``, default ``out``).
    """
    k = snap.step
    sdir = out / state_dir_name(k)
    try:
        sdir.mkdir(parents=True)
    except FileExistsError:
        raise ArtifactExistsError("a captured state already exists here and is never overwritten", where=sdir,
                                  hint="choose a new --out directory") from None
    adapter = adapter_bytes(snap.adapter.unpack())
    adapter_sha = sha256_bytes(adapter)
    atomic_write_bytes(sdir / ADAPTER_WEIGHTS, adapter, exclusive=True)
    pinned = write_state(sdir, k - 1, model_reference, {OPTIMIZER_FILE: optimizer_bytes_of(snap.optimizer.unpack())},
                         adapter_sha256=adapter_sha)
    nonfinite = has_nonfinite(snap.rows)  # here, off the training thread
    data = payload.encode(snap.rows, snap.rng)
    logical, effective = snap.rows.digests()
    pname = manifest.payload_name(k)
    atomic_write_bytes(out / pname, data, exclusive=True)
    state = {"dir": sdir.name, "step": k - 1, "optimizer_sha256": pinned[OPTIMIZER_FILE], "lr": snap.lr,
             "nonfinite_inputs": nonfinite}
    final = sha256_bytes(adapter_bytes(snap.final_adapter.unpack())) if snap.final_adapter is not None else None
    doc = manifest.build(
        step=k, producer=snap.producer, payload_file=pname, payload_size=len(data),
        payload_digest=payload.digest_bytes(data, where=out / pname), rng_keys=list(snap.rng),
        rows=payload.summary(snap.rows), logical=logical, effective=effective, resolved_config=resolved(cfg),
        contract=optimizer_contract(cfg), adapter_path=(sdir / ADAPTER_WEIGHTS).resolve(),
        adapter_size=len(adapter), adapter_sha256=adapter_sha, state=state,
        sealed=manifest.outcome(snap.loss, snap.grad_norm, final))  # the step record's numbers, pinned
    mname = manifest.manifest_name(k)
    sha = manifest.write(out / mname, doc)
    atomic_write_bytes(out / manifest.replay_config_name(k), replay_toml(cfg, k, logical, sha).encode("utf-8"),
                       exclusive=True)
    base = relative_to or out
    return step_record(step=k, manifest_path=str((out / mname).relative_to(base)), manifest_sha256=sha,
                       logical=logical, effective=effective, initial_adapter_sha256=adapter_sha,
                       final_adapter_sha256=final,
                       replay_config=str((out / manifest.replay_config_name(k)).relative_to(base)),
                       nonfinite_inputs=nonfinite, loss=snap.loss, grad_norm=snap.grad_norm)


def replay_toml(cfg: Config, step: int, logical: str, manifest_sha256: str) -> str:
    """The replay config of a captured step: the source's (redacted) config as an optimizer replay
    of exactly that step, with both pins and the paths (relative to this file) filled in."""
    name = manifest.replay_config_name(step)
    doc = resolved(cfg)
    doc["training"].update({"trainer": "optimizer_replay", "max_steps": 1, "save_every": 0})
    doc["resume"]["from"] = state_dir_name(step)
    doc["optimizer_batch"] = {**to_dict(OptimizerBatchConfig()), **section(
        replay_pins(manifest.manifest_name(step), logical, manifest_sha256), "optimizer_batch")}
    head = (f"# Replay of the captured step {step}: one update from its pinned start state, no dataset,\n"
            "# environment or sampling.  Paths are relative to this file.\n"
            f"# Check: replayjob explain {name}\n"
            f"# Run:   replayjob replay {name} --out replays/step_{step:06d} --repeat 3\n\n")
    return head + dumps(doc)


def state_reasons(m: manifest.Manifest | None, st: ResumeState, cfg: Config) -> list[str]:
    """Why the resume state ``st`` (and the replay config) cannot start the captured step (empty: it can).

    Without a verified manifest, or for a step-zero capture, the state must be of step -1."""
    pinned = m.state if m is not None else None
    if m is None or pinned is None:
        if st.step != -1:
            return [f"resume.from is a state at step {st.step}; replay starts from the source's initialisation "
                    "state (step -1)"]
        return []
    reasons = []
    if st.step != pinned["step"]:
        reasons.append(f"resume.from is a state at step {st.step}; step {m.step} starts from the state of step "
                       f"{pinned['step']} (its {state_dir_name(m.step)})")
    if st.files.get(OPTIMIZER_FILE) != pinned["optimizer_sha256"]:
        reasons.append(f"optimizer state mismatch: {st.path / OPTIMIZER_FILE} has SHA-256 "
                       f"{st.files.get(OPTIMIZER_FILE)}, the capture pins {pinned['optimizer_sha256']}")
    if any(lr != cfg.optimizer.lr for lr in pinned["lr"]):
        reasons.append(f"learning rate differs: the captured step ran at {pinned['lr']}, optimizer.lr is "
                       f"{cfg.optimizer.lr}")
    return reasons  # the non-finite flag is recomputed from the payload (the payload check's)


def restore_optimizer(optimizer: torch.optim.Optimizer, m: manifest.Manifest, st: ResumeState) -> None:
    """Load the pinned optimizer state of a chosen-step capture (a step-zero capture starts fresh)."""
    if m.state is not None:
        load_optimizer(optimizer, st.path / OPTIMIZER_FILE, str(m.state["optimizer_sha256"]))
