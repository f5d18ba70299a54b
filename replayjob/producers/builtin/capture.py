"""Capture: the source trainer's optimizer batch and RNG state at the optimizer boundary.

``replayjob capture CONFIG`` (or ``replayjob train`` with ``[optimizer_batch] capture = true``)
runs the normal source trainer with :class:`CaptureHook` (built by :mod:`replayjob.launch.source_run`).
Before any work the preconditions are checked: trainer ``grpo``, ``max_steps = 1``, ``save_every =
0``, and ``resume.from`` a local state whose ``trainer_state.json`` has ``step = -1`` (so the run
executes logical step zero exactly once).

The hook fires after advantage normalisation, clipping and the token cap, immediately before the
optimizer call.  On the training thread it only snapshots the rows (CPU tensors, cloned), the Torch
CPU/CUDA RNG state and the determinism provenance; once the update has returned it copies the adapter
after it (one process) and hands them, with the update's loss and gradient norm, to a writer thread,
so the update neither waits for encoding, hashing or ``fsync`` nor shares the cores with them (the
:class:`~replayjob.rl.hooks.BackgroundWriter` every capture shares).  The writer encodes and writes
``optimizer_batch_step_000000.safetensors``, then ``optimizer_batch_step_000000.manifest.json``
last; both atomically and exclusively, so a killed capture leaves no manifest or a complete one
whose payload verifies, and an existing capture is never overwritten.  The manifest seals the update's
``outcome`` (loss, gradient norm, the SHA-256 of the adapter after it), the numbers ``reduce`` compares
replays with; ``finish`` refuses a run whose metrics.json would report others.  The source run still
performs its own update; before ``metrics.json`` is written the trainer collects
:meth:`CaptureHook.finish`, which waits for the writer and re-raises any error it
met (the same domain error, so exit 2), then adds the digests a replay pins (:data:`METRIC_KEYS`).

Over several ranks (``torchrun``, :mod:`replayjob.runtime.distributed`) each rank's hook captures that rank's
shard of the rows into ``rank-<r>/`` and lands ``COMPLETE.<r>``; after a barrier rank 0 verifies every
rank and writes the root manifest (:mod:`replayjob.artifacts.capture_root`) before ``metrics.json``.

Crash tests kill a capture with ``REPLAYJOB_FAULT_POINT`` (:mod:`replayjob.crashpoints`): at any write
boundary of the payload or the manifest (``write.half/optimizer_batch_step_000000.manifest.json``
...), or at the capture's own points :data:`CRASH_POINTS`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.artifacts import capture_manifest as manifest
from replayjob.artifacts import capture_payload as payload
from replayjob.artifacts import capture_root as ranks
from replayjob.artifacts.metrics import (
    EFFECTIVE,
    FINAL_ADAPTER,
    INITIAL_ADAPTER,
    LOGICAL,
    MANIFEST,
    MANIFEST_PATH,
    PIN_KEYS,
    SOURCE_FILE,
    SOURCE_FINAL_ADAPTER,
    STEP,
    STEPS,
)
from replayjob.config import Config, resolved
from replayjob.crashpoints import point
from replayjob.digest import sha256_bytes
from replayjob.errors import ArtifactExistsError, ConfigError, IntegrityError, RefusedError
from replayjob.fsio import atomic_write_bytes
from replayjob.producers.builtin import ranks as rankrows
from replayjob.producers.builtin import steps as stepcapture
from replayjob.producers.contract import optimizer_contract
from replayjob.rl.batch import OptimizerBatch
from replayjob.rl.hooks import BackgroundWriter, StepHook, TrainerView
from replayjob.rl.state import ResumeState, adapter_bytes, read_state, rng_tensors
from replayjob.runtime import distributed

if TYPE_CHECKING:
    import torch

    # step, rows, RNG, producer, and the update as it returned: loss, grad norm, the adapter after it (one process)
    Snapshot = tuple[int, OptimizerBatch, dict[str, torch.Tensor], dict[str, Any], float, float,
                     stepcapture.Packed | None]

CRASH_POINTS = ("capture.start", "capture.before-payload", "capture.payload-written",
                "capture.manifest-written", "capture.after-update", "capture.metrics")
CAPTURE_STEP = 0
METRIC_KEYS = PIN_KEYS


def check_preconditions(cfg: Config) -> ResumeState:
    """Refuse, naming every reason, a config that would not capture exactly logical step zero."""
    reasons = []
    if cfg.training.trainer != "grpo":
        reasons.append(f"training.trainer must be 'grpo' to capture, found {cfg.training.trainer!r}")
    if cfg.training.max_steps != 1:
        reasons.append(f"training.max_steps must be 1 to capture, found {cfg.training.max_steps}")
    if cfg.training.save_every != 0:
        reasons.append(f"training.save_every must be 0 (periodic checkpoints off), found "
                       f"{cfg.training.save_every}")
    state = None
    if not cfg.resume.from_:
        reasons.append("resume.from must name an initialisation resume state (trainer_state.json step -1)")
    else:
        state = read_state(cfg.resume.from_)
        if state.step != -1:
            reasons.append(f"resume.from is a state at step {state.step}; capture needs an initialisation "
                           "state with step -1 so that logical step zero runs exactly once")
    if reasons or state is None:
        raise ConfigError("capture refused: " + "; ".join(reasons), where="[optimizer_batch] capture",
                          hint="run `replayjob init DIR` and use DIR/source.toml as the template")
    return state


class CaptureHook(StepHook):
    """A :class:`~replayjob.rl.hooks.StepHook` that captures step zero's optimizer batch."""

    def __init__(self, cfg: Config, out: Path, state: ResumeState):
        self.cfg, self.out, self.state = cfg, out, state
        self.digests: dict[str, str] = {}
        self._snapshot: Snapshot | None = None
        self._writer = BackgroundWriter("replayjob-capture-writer")  # idle until the update returned
        self.rank, self.world = distributed.rank(), distributed.world_size()
        self._view: TrainerView | None = None
        self.sealed: dict[str, Any] | None = None  # the manifest's outcome, checked against metrics.json's numbers

    @property
    def ranked(self) -> bool:
        """Over several ranks: this rank writes ``rank-<r>/`` and lands; rank 0 writes the root
        (:mod:`replayjob.artifacts.capture_root`)."""
        return self.world > 1

    @classmethod
    def prepare(cls, cfg: Config, out: Path) -> CaptureHook:
        """Check the preconditions and that ``out`` holds no capture yet (before any work)."""
        point("capture.start")
        state = check_preconditions(cfg)
        if distributed.world_size() > 1:
            ranks.refuse_existing(out, distributed.rank(), CAPTURE_STEP)
            return cls(cfg, out, state)
        for name in (manifest.payload_name(CAPTURE_STEP), manifest.manifest_name(CAPTURE_STEP)):
            if (out / name).exists():
                if (out / SOURCE_FILE).exists():
                    raise ArtifactExistsError("a capture already exists here and is never overwritten",
                                              where=out / name, hint="choose a new --out directory")
                raise ArtifactExistsError("an interrupted capture (no metrics.json) already exists here and "
                                          "is never overwritten", where=out / name,
                                          hint=f"remove {out} and rerun, or choose a new --out directory")
        return cls(cfg, out, state)

    def on_train_begin(self, view: TrainerView) -> None:
        self._view = view  # the adapter after the update is sealed in the manifest (one process)

    def before_update(self, step: int, batch: OptimizerBatch) -> None:
        if step != CAPTURE_STEP:  # preconditions make this unreachable; refuse rather than mislabel
            raise ConfigError(f"capture covers step {CAPTURE_STEP} only, the trainer is at step {step}")
        point("capture.before-payload")
        rows = OptimizerBatch(**{k: v.detach().to("cpu").clone() for k, v in batch.tensors().items()})
        rng = {k: v.clone() for k, v in rng_tensors().items()}
        producer = stepcapture.producer(self.cfg)  # the determinism state at the capture point
        self._snapshot = (step, rows, rng, producer, math.nan, math.nan, None)

    def after_update(self, step: int, result: Any) -> None:
        """Hand the snapshot, with the update's loss, gradient norm and (one process) a copy of the adapter after
        it, to the idle writer once the update is done (it never competes with the update)."""
        point("capture.after-update")
        if self._snapshot is None or self._snapshot[0] != step:
            return
        after = stepcapture.clone_adapter(self._view) if self._view is not None and not self.ranked else None
        loss, grad_norm = (float(getattr(result, k, math.nan)) for k in ("loss", "grad_norm"))
        snapshot = (*self._snapshot[:4], loss, grad_norm, after)
        self._snapshot = None
        self._writer.submit(lambda: self._write(*snapshot))

    def _write(self, step: int, batch: OptimizerBatch, rng: dict[str, torch.Tensor],
               producer: dict[str, Any], loss: float, grad_norm: float, after: stepcapture.Packed | None) -> None:
        """The writer thread: payload, then the manifest last (an error is re-raised by :meth:`finish`); one
        process seals the update's outcome in it (over ranks the root, written by :meth:`finish`, does)."""
        data = payload.encode(batch, rng)
        logical, effective = batch.digests()
        pname = manifest.payload_name(step)
        where = self.out / ranks.rank_dir(self.rank) if self.ranked else self.out
        if self.ranked:
            where.mkdir(parents=True)  # refused before any work if it existed
        atomic_write_bytes(where / pname, data, exclusive=True)
        point("capture.payload-written")
        adapter = self.state.adapter_file
        if after is not None:  # the bytes the trainer's final adapter file holds (max_steps = 1: this update's)
            self.sealed = manifest.outcome(loss, grad_norm, sha256_bytes(adapter_bytes(after.unpack())))
        doc = manifest.build(
            step=step, producer=producer, payload_file=pname, payload_size=len(data),
            payload_digest=payload.digest_bytes(data, where=where / pname), rng_keys=list(rng),
            rows=payload.summary(batch), logical=logical, effective=effective,
            resolved_config=resolved(self.cfg), contract=optimizer_contract(self.cfg),
            adapter_path=adapter.resolve(), adapter_size=adapter.stat().st_size,
            adapter_sha256=self.state.adapter_sha256, sealed=None if self.ranked else self.sealed)
        sha = manifest.write(where / manifest.manifest_name(step), doc)
        point("capture.manifest-written")
        if self.ranked:
            ranks.land(self.out, self.rank, self.world, sha)
        self.digests = {LOGICAL: logical, EFFECTIVE: effective, MANIFEST: sha,
                        INITIAL_ADAPTER: self.state.adapter_sha256}

    def finish(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Wait for the writer (re-raising its error: the same domain error, so exit 2); then the keys
        added to the source run's metrics.json: the digests a replay pins."""
        self._writer.drain()
        if self._snapshot is not None:  # never handed over: the writer was released with nothing
            raise RefusedError("the optimizer batch was snapshotted but its update never returned, so the capture "
                               "was not written", where=self.out, hint="rerun the capture into a new --out directory")
        if self.ranked:
            distributed.barrier()  # every rank landed (or raised: the group times out, torchrun stops the rest)
            if not distributed.is_root():
                return {}
            d = self.cfg.distributed
            self.sealed = manifest.outcome(metrics.get("loss"), metrics.get("grad_norm"),
                                           metrics[SOURCE_FINAL_ADAPTER])
            logical, effective, sha = rankrows.write_root(
                self.out, step=CAPTURE_STEP, world=self.world, strategy=d.strategy, bucket_cap_mb=d.bucket_cap_mb,
                backend=distributed.backend_for(self.cfg.backend.torch_device), producer=stepcapture.producer(self.cfg),
                sealed=self.sealed)
            self.digests = {LOGICAL: logical, EFFECTIVE: effective, MANIFEST: sha,
                            INITIAL_ADAPTER: self.state.adapter_sha256}
        reported = manifest.outcome(metrics.get("loss"), metrics.get("grad_norm"), metrics[SOURCE_FINAL_ADAPTER])
        if self.sealed != reported:  # reduce would refuse this capture: say so now, naming both
            raise IntegrityError(f"the capture manifest seals the update's outcome {self.sealed}, but the run "
                                 f"reports {reported} for metrics.json", where=self.out,
                                 hint="the update is not reproducible within this run; report it as a bug")
        point("capture.metrics")
        return {**self.digests, FINAL_ADAPTER: metrics[SOURCE_FINAL_ADAPTER],
                MANIFEST_PATH: manifest.manifest_name(CAPTURE_STEP)}

    def abandon(self) -> None:
        """Release the writer and wait for it: a snapshot already handed over is written first."""
        self._writer.release()


class StepsCapture(StepHook):
    """``[optimizer_batch] capture_steps``: capture chosen steps of a run of any length.

    Each chosen step is captured self-sufficiently (:mod:`~replayjob.producers.builtin.steps`): the
    training thread clones the rows, RNG, adapter and optimizer state before the update and the
    adapter after it; the writer writes once the update has returned.  ``finish`` adds
    ``optimizer_batch/steps`` to metrics.json: per step its pins, including the SHA-256 of the
    adapter after the real update.
    """

    def __init__(self, cfg: Config, out: Path, steps: list[int]):
        self.cfg, self.out, self.steps = cfg, out, sorted(steps)
        self.captured: list[dict[str, Any]] = []
        self._view: TrainerView | None = None
        self._producer: dict[str, Any] = {}
        self._pending: stepcapture.StepSnapshot | None = None
        self._writer = BackgroundWriter("replayjob-steps-writer")  # idle until a chosen update returned

    @classmethod
    def prepare(cls, cfg: Config, out: Path) -> StepsCapture:
        """Refuse (before any work) steps the run never reaches, a step-zero capture in the same run,
        and captures already in ``out``."""
        steps = cfg.optimizer_batch.capture_steps
        where = "optimizer_batch.capture_steps"
        if cfg.optimizer_batch.capture:
            raise ConfigError("capture = true (the step-zero capture) and capture_steps cannot be combined",
                              where=where, hint="list 0 in capture_steps instead, or drop capture_steps")
        late = [k for k in steps if k >= cfg.training.max_steps]
        if late:
            raise ConfigError(f"steps {late} are not reached: the run's last step is {cfg.training.max_steps - 1}",
                              where=where, hint="raise training.max_steps or drop those steps")
        stepcapture.refuse_existing(out, steps, "capture")
        return cls(cfg, out, steps)

    def on_train_begin(self, view: TrainerView) -> None:
        early = [k for k in self.steps if k < view.start_step]
        if early:
            raise ConfigError(f"steps {early} come before the resume state's next step {view.start_step}",
                              where="optimizer_batch.capture_steps", hint="capture steps this run executes")
        self._view = view
        self._producer = stepcapture.producer(self.cfg)  # the determinism state, fixed for the run

    def before_update(self, step: int, batch: OptimizerBatch) -> None:
        if step in self.steps:
            assert self._view is not None  # on_train_begin runs before any step
            self._pending = stepcapture.take(step, batch, self._view, self._producer)

    def after_update(self, step: int, result: Any) -> None:
        snap = self._pending
        if snap is None or snap.step != step:
            return
        assert self._view is not None
        self._pending = None
        snap.final_adapter = stepcapture.clone_adapter(self._view)
        snap.updated(result)
        ref = self._view.model_reference
        self._writer.submit(lambda: self.captured.append(stepcapture.write(self.out, snap, self.cfg, ref)))

    def finish(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Wait for the writer (re-raising its first error); every chosen step's pins for metrics.json."""
        self._writer.drain()
        missing = sorted(set(self.steps) - {int(c[STEP]) for c in self.captured})
        if missing:
            raise RefusedError(f"steps {missing} were chosen but not captured (their update never returned)",
                               where=self.out, hint="rerun into a new --out directory")
        return {STEPS: sorted(self.captured, key=lambda c: int(c[STEP]))}

    def abandon(self) -> None:
        self._writer.release()
