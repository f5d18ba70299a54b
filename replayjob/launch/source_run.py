"""The source run as ``replayjob train`` and ``replayjob capture`` start it: the hooks, then the trainer.

The trainer (:mod:`replayjob.producers.builtin.trainer`) is handed its hooks and imports no capture package;
this module is where the config and the environment choose them (:func:`source_hooks`):

* ``[optimizer_batch] capture = true`` -- :class:`~replayjob.producers.builtin.capture.CaptureHook`
  (step zero from a step -1 state, ``max_steps = 1``);
* ``[optimizer_batch] capture_steps = [K, ...]`` -- :class:`~replayjob.producers.builtin.capture.StepsCapture`
  (chosen steps of a run of any length);
* ``[optimizer_batch] ring_size = N`` -- :class:`~replayjob.producers.builtin.ring.RingCapture` (the last N
  steps, written when an anomaly trigger fires);
* ``REPLAYJOB_BUNDLE_CAPTURE=1`` -- :class:`~replayjob.bundle.hook.BundleCapture`.

Under ``torchrun`` (:func:`train_command`) the world size is observed into the config and the process
group wraps the run; over several ranks only the step-zero capture is offered (chosen steps, the ring
buffer and trajectory bundles capture one process and are refused).

Each hook's preconditions are checked as it is built, before any training work.  Until the hooks
reach the trainer this module owns them: if building one fails, the ones already built are
abandoned (their writer threads released) before the refusal propagates.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replayjob.bundle.hook import capture_from_env
from replayjob.config import Config, load_config
from replayjob.errors import ConfigError
from replayjob.producers.builtin.capture import CaptureHook, StepsCapture
from replayjob.producers.builtin.ring import RingCapture
from replayjob.producers.builtin.trainer import train
from replayjob.rl.hooks import StepHook, abandon_all
from replayjob.runtime import distributed


def source_hooks(cfg: Config, out: Path) -> list[StepHook]:
    """The capture hooks ``cfg`` and the environment ask for, preconditions checked, in call order."""
    hooks: list[StepHook] = []
    ob = cfg.optimizer_batch
    if distributed.world_size() > 1 and (ob.capture_steps or ob.ring_size):
        raise ConfigError("capture_steps and the ring buffer capture one process's steps; over several ranks "
                          "only the step-zero capture (optimizer_batch.capture) is supported",
                          where="optimizer_batch", hint="run them without torchrun, or capture step zero")
    try:
        if cfg.optimizer_batch.capture:
            hooks.append(CaptureHook.prepare(cfg, out))
        if cfg.optimizer_batch.capture_steps:
            hooks.append(StepsCapture.prepare(cfg, out))
        if cfg.optimizer_batch.ring_size:
            hooks.append(RingCapture.prepare(cfg, out))
        bundles = capture_from_env(cfg)  # on only with REPLAYJOB_BUNDLE_CAPTURE=1
        if bundles is not None and distributed.world_size() > 1:
            bundles.abandon()
            raise ConfigError("trajectory bundles are captured from one process; REPLAYJOB_BUNDLE_CAPTURE=1 is "
                              "refused over several ranks", where="REPLAYJOB_BUNDLE_CAPTURE",
                              hint="unset it, or run without torchrun")
        if bundles is not None:
            hooks.append(bundles)
    except BaseException:
        abandon_all(hooks)
        raise
    return hooks


def train_source(cfg: Config, out: Path, extra_hooks: Sequence[StepHook] = ()) -> dict[str, Any]:
    """Run the source trainer with ``extra_hooks`` (called first) and the configured capture hooks: the one
    entry of every source run, where its config is resolved (:func:`replayjob.runtime.distributed.observe`: the
    world size the run records is the launcher's)."""
    try:
        cfg = distributed.observe(cfg)
        hooks = [*extra_hooks, *source_hooks(cfg, out)]
    except BaseException:
        abandon_all(extra_hooks)
        raise
    return train(cfg, out, hooks)  # owns the hooks from here: finished or abandoned


def train_command(config: str | Path, overrides: list[str], out: str | Path | None,
                  capture: bool = False) -> tuple[Path, dict[str, Any]]:
    """``replayjob train`` (``capture``: ``replayjob capture``) in this process, one rank of several under
    torchrun (:mod:`replayjob.runtime.distributed`): the world size observed into the config, the process group
    around the run (the config is resolved by :func:`train_source`).  Returns (out dir, metrics); ``{}`` on a
    rank other than 0 (rank 0 writes metrics.json)."""
    cfg = load_config(config, [*overrides, *(["optimizer_batch.capture=true"] if capture else [])])
    out_dir = Path(out or cfg.logging.dir)
    with distributed.process_group(cfg):
        return out_dir, train_source(cfg, out_dir)


def capture(config: str | Path, overrides: list[str], out: str | Path | None) -> tuple[Path, dict[str, Any]]:
    """``replayjob capture``: run the source trainer with capture on; return (out dir, metrics)."""
    return train_command(config, overrides, out, capture=True)
