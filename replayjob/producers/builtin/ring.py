"""Always-on capture: a ring buffer of the last N steps, written when an anomaly trigger fires.

``[optimizer_batch] ring_size = N`` keeps, in host memory, the last N steps' snapshots
(:class:`~replayjob.producers.builtin.steps.StepSnapshot`: rows, RNG, adapter, optimizer state and
learning rate), each self-sufficient, so every buffered step replays on its own.  After each
update the triggers are evaluated on the step's loss and gradient norm:

* a non-finite loss or gradient norm (always on);
* ``ring_grad_norm_above``: the gradient norm above a threshold;
* ``ring_grad_norm_median_multiple``: the gradient norm above that multiple of the running median
  of the earlier steps' norms (the last :data:`HISTORY` steps);
* ``ring_loss_spike_multiple``: ``|loss|`` above that multiple of the running median ``|loss|``;
* a user callback ``trigger(step, result) -> reason | None`` passed to :class:`RingCapture`.

The first trigger hands the buffered steps to the hook's background writer, which writes each as
a chosen-step capture under ``OUT/ring/`` (same file names, a ready ``replay_step_<K>.toml``
each); the ring then stops (one write per run, so a diverged run cannot fill the disk).  A
buffered step's adapter after its real update is the next buffered step's starting adapter, and
the triggering step's is cloned when the trigger fires, so every entry records the SHA-256 a
replay must reproduce.  The replay of the triggering step itself reproduces the inputs, not a
fault planted into that step's update (``REPLAYJOB_FAULT_NONFINITE_GRAD``).

Bounds and costs, reported in ``metrics.json`` under ``optimizer_batch/ring``: ``peak_bytes``
(the most host memory the buffered snapshots held), ``training_thread_s`` (time spent inside the
hook's calls on the training thread, from its own timers: clones and trigger checks only; the
training thread never waits on disk), the steps observed, the trigger (step and reason) and the
pins of every step written.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from replayjob.artifacts.metrics import (
    RING,
    RING_PEAK_BYTES,
    RING_SIZE,
    RING_STEPS_OBSERVED,
    RING_TRAINING_THREAD_S,
    RING_TRIGGER,
    RING_WRITTEN,
)
from replayjob.config import Config
from replayjob.errors import ArtifactExistsError
from replayjob.producers.builtin import steps as stepcapture
from replayjob.rl.batch import OptimizerBatch
from replayjob.rl.hooks import BackgroundWriter, StepHook, TrainerView
from replayjob.rl.update import UpdateResult

RING_DIR = "ring"
HISTORY = 100  # steps behind each running median
Trigger = Callable[[int, UpdateResult], str | None]


def triggered(cfg: Config, loss: float, grad_norm: float, norms: deque[float], losses: deque[float]) -> str | None:
    """The configured trigger that ``loss`` and ``grad_norm`` fire, given earlier steps' values (None: none)."""
    ob = cfg.optimizer_batch
    if not math.isfinite(loss) or not math.isfinite(grad_norm):
        return f"non-finite loss or gradient norm (loss {loss!r}, grad_norm {grad_norm!r})"
    if ob.ring_grad_norm_above and grad_norm > ob.ring_grad_norm_above:
        return f"gradient norm {grad_norm!r} above {ob.ring_grad_norm_above!r}"
    if ob.ring_grad_norm_median_multiple and norms:
        median = statistics.median(norms)
        if grad_norm > ob.ring_grad_norm_median_multiple * median:
            return (f"gradient norm {grad_norm!r} above {ob.ring_grad_norm_median_multiple!r} x running median "
                    f"{median!r}")
    if ob.ring_loss_spike_multiple and losses:
        median = statistics.median(losses)
        if abs(loss) > ob.ring_loss_spike_multiple * median:
            return f"|loss| {abs(loss)!r} above {ob.ring_loss_spike_multiple!r} x running median {median!r}"
    return None


class RingCapture(StepHook):
    """The ring buffer hook (see the module docstring)."""

    def __init__(self, cfg: Config, out: Path, trigger: Trigger | None = None):
        self.cfg, self.out, self.user_trigger = cfg, out, trigger
        self.ring: deque[stepcapture.StepSnapshot] = deque(maxlen=cfg.optimizer_batch.ring_size)
        self.norms: deque[float] = deque(maxlen=HISTORY)
        self.losses: deque[float] = deque(maxlen=HISTORY)
        self.fired: dict[str, Any] | None = None
        self.written: list[dict[str, Any]] = []
        self.peak_bytes = 0
        self.seconds = 0.0
        self.steps = 0
        self._view: TrainerView | None = None
        self._producer: dict[str, Any] = {}
        self._writer = BackgroundWriter("replayjob-ring-writer")  # idle until a trigger fires

    @classmethod
    def prepare(cls, cfg: Config, out: Path, trigger: Trigger | None = None) -> RingCapture:
        """Refuse (before any work) when ``out`` already holds a ring-buffer write."""
        if (out / RING_DIR).exists():
            raise ArtifactExistsError("a ring-buffer capture already exists here and is never overwritten",
                                      where=out / RING_DIR, hint="choose a new --out directory")
        return cls(cfg, out, trigger)

    def on_train_begin(self, view: TrainerView) -> None:
        self._view = view
        self._producer = stepcapture.producer(self.cfg)  # the determinism state, fixed for the run

    def before_update(self, step: int, batch: OptimizerBatch) -> None:
        if self.fired is not None:
            return
        t0 = time.perf_counter()
        assert self._view is not None  # on_train_begin runs before any step
        full = len(self.ring) == self.ring.maxlen
        oldest = self.ring.popleft() if full else None  # its buffers are refilled: no allocation per step
        self.ring.append(stepcapture.take(step, batch, self._view, self._producer, reuse=oldest))
        self.peak_bytes = max(self.peak_bytes, sum(s.nbytes for s in self.ring))
        self.seconds += time.perf_counter() - t0

    def after_update(self, step: int, result: UpdateResult) -> None:
        if self.fired is not None:
            return
        t0 = time.perf_counter()
        self.steps += 1
        if self.ring and self.ring[-1].step == step:
            self.ring[-1].updated(result)
        reason = triggered(self.cfg, result.loss, result.grad_norm, self.norms, self.losses)
        if reason is None and self.user_trigger is not None:
            reason = self.user_trigger(step, result)
        if reason is None:
            self.norms.append(result.grad_norm)
            self.losses.append(abs(result.loss))
        elif self.ring and self.ring[-1].step == step:
            self._fire(step, reason)
        self.seconds += time.perf_counter() - t0

    def _fire(self, step: int, reason: str) -> None:
        assert self._view is not None
        self.fired = {"step": step, "reason": reason}
        entries = list(self.ring)
        self.ring.clear()
        for earlier, later in itertools.pairwise(entries):
            earlier.final_adapter = later.adapter  # unchanged between an update and the next step's start
        entries[-1].final_adapter = stepcapture.clone_adapter(self._view)
        ref, out = self._view.model_reference, self.out / RING_DIR

        def write_all() -> None:
            for snap in entries:
                self.written.append(stepcapture.write(out, snap, self.cfg, ref, relative_to=self.out))

        self._writer.submit(write_all)

    def finish(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Wait for the writer (re-raising its first error); the ring's figures and pins for metrics.json."""
        self._writer.drain()
        return {RING: {
            RING_SIZE: self.cfg.optimizer_batch.ring_size, RING_STEPS_OBSERVED: self.steps,
            RING_PEAK_BYTES: self.peak_bytes, RING_TRAINING_THREAD_S: self.seconds, RING_TRIGGER: self.fired,
            RING_WRITTEN: list(self.written)}}

    def abandon(self) -> None:
        self._writer.release()
