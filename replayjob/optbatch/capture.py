"""Capture: the source trainer's optimizer batch and RNG state at the optimizer boundary.

``replayjob capture CONFIG`` (or ``replayjob train`` with ``[optimizer_batch] capture = true``)
runs the normal source trainer with :class:`CaptureHook`.  Before any work the preconditions are
checked: trainer ``grpo``, ``max_steps = 1``, ``save_every = 0``, and ``resume.from`` a local state
whose ``trainer_state.json`` has ``step = -1`` (so the run executes logical step zero exactly once).

The hook fires after advantage normalisation, clipping and the token cap, immediately before the
optimizer call.  On the training thread it only snapshots the rows (CPU tensors, cloned), the Torch
CPU/CUDA RNG state and the determinism provenance; once the update has returned it hands them to a
writer thread, so the update neither waits for encoding, hashing or ``fsync`` nor shares the
cores with them.  The writer encodes and writes
``optimizer_batch_step_000000.safetensors``, then ``optimizer_batch_step_000000.manifest.json``
last; both atomically and exclusively, so a killed capture leaves no manifest or a complete one
whose payload verifies, and an existing capture is never overwritten.  The source run still
performs its own update; before ``metrics.json`` is written the trainer collects
:meth:`CaptureHook.contribute_metrics`, which waits for the writer and re-raises any error it
met (the same domain error, so exit 2), then adds the digests a replay pins (:data:`METRIC_KEYS`).

Crash tests kill a capture with ``REPLAYJOB_FAULT_POINT`` (:mod:`replayjob.faults`): at any write
boundary of the payload or the manifest (``write.half/optimizer_batch_step_000000.manifest.json``
...), or at the capture's own points :data:`CRASH_POINTS`.
"""

from __future__ import annotations

import platform
import queue
import threading
from pathlib import Path
from typing import Any

import torch

import replayjob
from replayjob import determinism
from replayjob.config import Config, load_config, resolved
from replayjob.errors import ArtifactExistsError, ConfigError, RefusedError
from replayjob.faults import point
from replayjob.fsio import atomic_write_bytes
from replayjob.metrics import (
    EFFECTIVE,
    FINAL_ADAPTER,
    INITIAL_ADAPTER,
    LOGICAL,
    MANIFEST,
    MANIFEST_PATH,
    PIN_KEYS,
    SOURCE_FILE,
    SOURCE_FINAL_ADAPTER,
)
from replayjob.optbatch import manifest, payload
from replayjob.optbatch.contract import optimizer_contract
from replayjob.rl.batch import OptimizerBatch
from replayjob.rl.state import ResumeState, read_state, rng_tensors

CRASH_POINTS = ("capture.start", "capture.before-payload", "capture.payload-written",
                "capture.manifest-written", "capture.after-update", "capture.metrics")
CAPTURE_STEP = 0
Snapshot = tuple[int, OptimizerBatch, dict[str, torch.Tensor], dict[str, Any]]  # step, rows, RNG, producer
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


def _producer(cfg: Config) -> dict[str, Any]:
    strict = cfg.backend.options.strict_deterministic
    prov = {"strict_deterministic": strict, "math_mode": determinism.math_mode_from_env(strict),
            "attn_implementation": cfg.backend.options.attn_implementation, **determinism.snapshot()}
    device = cfg.backend.torch_device
    out: dict[str, Any] = {"replayjob_version": replayjob.__version__, "torch_version": torch.__version__,
                           "python": platform.python_version(), "device": device, "provenance": prov}
    if device.startswith("cuda") and torch.cuda.is_available():
        out["device_name"] = torch.cuda.get_device_name(torch.device(device))
    return out


class CaptureHook:
    """A :class:`~replayjob.rl.trainer.StepHooks` that captures step zero's optimizer batch."""

    def __init__(self, cfg: Config, out: Path, state: ResumeState):
        self.cfg, self.out, self.state = cfg, out, state
        self.digests: dict[str, str] = {}
        self._error: BaseException | None = None
        self._snapshot: Snapshot | None = None
        # Started idle now, before training: a thread started at the step's end would cost the
        # training thread a GIL switch interval (about 5 ms) while it bootstraps into busy work.
        self._handoff: queue.SimpleQueue[Snapshot | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = threading.Thread(target=self._serve, daemon=True,
                                                                 name="replayjob-capture-writer")
        self._writer.start()

    @classmethod
    def prepare(cls, cfg: Config, out: Path) -> CaptureHook:
        """Check the preconditions and that ``out`` holds no capture yet (before any work)."""
        point("capture.start")
        state = check_preconditions(cfg)
        for name in (manifest.payload_name(CAPTURE_STEP), manifest.manifest_name(CAPTURE_STEP)):
            if (out / name).exists():
                if (out / SOURCE_FILE).exists():
                    raise ArtifactExistsError("a capture already exists here and is never overwritten",
                                              where=out / name, hint="choose a new --out directory")
                raise ArtifactExistsError("an interrupted capture (no metrics.json) already exists here and "
                                          "is never overwritten", where=out / name,
                                          hint=f"remove {out} and rerun, or choose a new --out directory")
        return cls(cfg, out, state)

    def on_rollout(self, rollout: Any) -> None:
        return None

    def before_update(self, step: int, batch: OptimizerBatch) -> None:
        if step != CAPTURE_STEP:  # preconditions make this unreachable; refuse rather than mislabel
            raise ConfigError(f"capture covers step {CAPTURE_STEP} only, the trainer is at step {step}")
        point("capture.before-payload")
        rows = OptimizerBatch(**{k: v.detach().to("cpu").clone() for k, v in batch.tensors().items()})
        rng = {k: v.clone() for k, v in rng_tensors().items()}
        producer = _producer(self.cfg)  # the determinism state at the capture point
        self._snapshot = (step, rows, rng, producer)

    def after_update(self, step: int, result: Any) -> None:
        """Start the writer once the update is done, so it never competes with the update for cores."""
        point("capture.after-update")
        if self._snapshot is None or self._snapshot[0] != step:
            return
        snapshot, self._snapshot = self._snapshot, None
        self._handoff.put(snapshot)  # the idle writer wakes; nothing here waits for it

    def _serve(self) -> None:
        """The writer thread: wait for the one snapshot (None: nothing to write), then write it."""
        snapshot = self._handoff.get()
        if snapshot is not None:
            self._write(*snapshot)

    def _write(self, step: int, batch: OptimizerBatch, rng: dict[str, torch.Tensor],
               producer: dict[str, Any]) -> None:
        """The writer thread: payload, then the manifest last; an error is kept for :meth:`finish`."""
        try:
            data = payload.encode(batch, rng)
            logical, effective = batch.digests()
            pname = manifest.payload_name(step)
            atomic_write_bytes(self.out / pname, data, exclusive=True)
            point("capture.payload-written")
            adapter = self.state.adapter_file
            doc = manifest.build(
                step=step, producer=producer, payload_file=pname, payload_size=len(data),
                payload_digest=payload.digest_bytes(data, where=self.out / pname), rng_keys=list(rng),
                rows=payload.summary(batch), logical=logical, effective=effective,
                resolved_config=resolved(self.cfg), contract=optimizer_contract(self.cfg),
                adapter_path=adapter.resolve(), adapter_size=adapter.stat().st_size,
                adapter_sha256=self.state.adapter_sha256)
            sha = manifest.write(self.out / manifest.manifest_name(step), doc)
            point("capture.manifest-written")
            self.digests = {LOGICAL: logical, EFFECTIVE: effective, MANIFEST: sha,
                            INITIAL_ADAPTER: self.state.adapter_sha256}
        except BaseException as exc:  # re-raised on the training thread by finish()
            self._error = exc

    def finish(self) -> None:
        """Wait for the writer thread; re-raise the error it met, if any (payload and manifest are done)."""
        self.abandon()
        if self._snapshot is not None:  # never handed over: the writer was released with nothing
            raise RefusedError("the optimizer batch was snapshotted but its update never returned, so the capture "
                               "was not written", where=self.out, hint="rerun the capture into a new --out directory")
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def abandon(self) -> None:
        """Release the writer and wait for it: a snapshot already handed over is written first (the
        ``None`` that wakes an idle writer is never read after one)."""
        if self._writer is not None:
            self._handoff.put(None)
            self._writer.join()
            self._writer = None

    def contribute_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Keys added to the source run's metrics.json: the digests a replay pins (after the writer)."""
        self.finish()
        point("capture.metrics")
        return {**self.digests, FINAL_ADAPTER: metrics[SOURCE_FINAL_ADAPTER],
                MANIFEST_PATH: manifest.manifest_name(CAPTURE_STEP)}


def capture(config: str | Path, overrides: list[str], out: str | Path | None) -> tuple[Path, dict[str, Any]]:
    """``replayjob capture``: run the source trainer with capture on; return (out dir, metrics)."""
    from replayjob.rl.trainer import train

    cfg = load_config(config, [*overrides, "optimizer_batch.capture=true"])
    out_dir = Path(out or cfg.logging.dir)
    return out_dir, train(cfg, out_dir)
