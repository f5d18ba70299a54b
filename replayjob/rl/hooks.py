"""The step-hook protocol: what a trainer calls at each step and what every capture implements.

A trainer is handed its hooks (a sequence of :class:`StepHook`) and imports no capture package;
captures (``replayjob.producers.builtin.capture``, ``replayjob.bundle.hook``) import this module, never the
trainer.  The command layer (:mod:`replayjob.run`) builds the hooks a config and the environment
ask for and hands them over.

Once before the first step, ``on_train_begin(view)`` hands the hook a :class:`TrainerView`: read
access to the live adapter and optimizer (what a capture of a step after the first needs).  A hook
must not modify them; it reads them only inside its own calls, on the training thread.

Then, in call order, for each step the trainer runs:

1. ``on_rollout(rollout)`` -- the step's rollout is complete (sampled, scored, advantages
   estimated, loss weights set); ``rollout`` is a :class:`StepRollout`.  The hook may copy
   tensors; it must not modify them or consume random numbers.
2. ``before_update(step, batch)`` -- immediately before the optimizer update: ``batch`` is the
   :class:`~replayjob.rl.batch.OptimizerBatch` the update consumes and the Torch RNG, the model's
   adapter and the optimizer hold exactly the state the update starts from.  A hook snapshots
   what it needs here (clones on the CPU); it must not write to disk or change any state.
3. ``after_update(step, result)`` -- the update has returned (``result`` is its
   :class:`~replayjob.rl.update.UpdateResult`; the adapter and optimizer hold the updated state).
   This is where a hook hands work to its :class:`BackgroundWriter`; nothing here waits on disk.

Once after the last step (training succeeded), ``finish(metrics)`` is called on each hook in
order, before ``metrics.json`` is written.  ``metrics`` is a read-only copy of the run's metrics
so far; the hook drains its writer (re-raising the first error it met, the same exception) and
returns the flat keys to merge into ``metrics.json`` (``{}`` when none).  If anything fails --
building another hook, a step, another hook's ``finish`` -- ``abandon()`` is called on every hook
instead: it releases the writer thread after the work already handed over, keeps its errors to
itself and never raises.  ``abandon`` after ``finish`` (or twice) does nothing.  Whoever builds a
hook owns this obligation until it hands the hook to the trainer, which then owns it.

A hook that needs the per-token log-probabilities the update's loss saw sets
:attr:`StepHook.wants_update_logprobs`; the trainer then keeps them in ``result.logprobs``.

Subclass :class:`StepHook` (its methods are no-ops) and override what the hook needs.

Example:
    >>> class CountSteps(StepHook):
    ...     def __init__(self) -> None:
    ...         self.n = 0
    ...     def after_update(self, step: int, result: Any) -> None:
    ...         self.n += 1
    ...     def finish(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
    ...         return {"count_steps/n": self.n}
    >>> h = CountSteps(); h.after_update(0, None); h.finish({})
    {'count_steps/n': 1}
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from replayjob.rl.batch import OptimizerBatch
from replayjob.rl.update import UpdateResult

if TYPE_CHECKING:
    import torch
    from torch import Tensor



@dataclass
class StepRollout:
    """What the stages consumed and produced in one step (padded ``[N, T]`` per-token fields)."""

    step: int
    prompts: list[str]
    answers: list[str]
    completions: list[str]
    prompt_tokens: list[list[int]]
    response_tokens: list[list[int]]
    group: Tensor           # [N] semantic group (prompt index)
    raw: Tensor             # reward.raw [N]
    scores: Tensor          # reward.post_process [N]
    mask: Tensor            # [N, T] response-token mask
    old_logprobs: Tensor    # [N, T]
    ref_logprobs: Tensor    # [N, T]
    kl: Tensor              # advantage.kl [N, T]
    advantages: Tensor      # advantage.estimate (after batch norm / clip) [N, T]
    loss_mask: Tensor       # mask after the token cap
    loss_weights: Tensor    # [N, T]


@dataclass(frozen=True)
class TrainerView:
    """Read access to the trainer's live state, handed to :meth:`StepHook.on_train_begin`.

    ``adapter_state()`` returns the adapter tensors under the names the adapter weight file uses
    (views of the live parameters: clone what you keep); ``optimizer`` is the live optimizer;
    ``model_reference`` describes the base model (what a resume state is checked against);
    ``start_step`` is the first step this run executes.
    """

    adapter_state: Callable[[], dict[str, Tensor]]
    optimizer: torch.optim.Optimizer
    model_reference: dict[str, Any]
    start_step: int


class StepHook(Protocol):
    """One capture (or probe) the trainer calls at each step; see the module docstring for the contract."""

    wants_update_logprobs: ClassVar[bool] = False

    def on_train_begin(self, view: TrainerView) -> None:
        """Once, before the first step: read access to the live adapter and optimizer."""
        return None

    def on_rollout(self, rollout: StepRollout) -> None:
        """The step's rollout is complete; copy what is needed, change nothing."""
        return None

    def before_update(self, step: int, batch: OptimizerBatch) -> None:
        """Immediately before the update: snapshot (on the CPU) what the update starts from."""
        return None

    def after_update(self, step: int, result: UpdateResult) -> None:
        """The update returned: hand work to the background writer; never wait on disk."""
        return None

    def finish(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Training succeeded: drain the writer, re-raise its first error, return keys for metrics.json."""
        return {}

    def abandon(self) -> None:
        """Training failed: release the writer after the work handed over; never raises."""
        return None


def abandon_all(hooks: Iterable[StepHook]) -> None:
    """Abandon every hook (each releases its writer after the work handed over); never raises."""
    for h in hooks:
        h.abandon()


class BackgroundWriter:
    """The one background writer thread of a capture hook.

    The thread is started idle when the writer is built (with its hook, before training): starting
    a thread inside a step costs the training thread about one GIL switch interval (5 ms) while the
    new thread bootstraps, whereas handing work to an idle one costs a queue put (well under 0.1
    ms; ``benchmarks/README.md``, capture_overhead).  Jobs (callables) run one at a time, in the
    order submitted; a job's exception is kept and the next job still runs.

    * :meth:`submit` -- hand over a job (after the update returned); never waits.
    * :meth:`drain` -- wait for every job, stop the thread, re-raise the first error kept.
    * :meth:`release` -- wait for the jobs already handed over, stop the thread, raise nothing
      (errors stay in :attr:`errors`).  Idempotent; :meth:`drain` calls it.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.errors: list[BaseException] = []
        self._jobs: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def submit(self, job: Callable[[], object]) -> None:
        """Queue ``job`` for the writer thread; returns at once."""
        if self._thread is None:
            raise RuntimeError(f"{self.name}: work submitted after the writer was released")
        self._jobs.put(job)

    def fail(self, exc: BaseException) -> None:
        """Keep an error found on the training thread; :meth:`drain` re-raises it in order."""
        self.errors.append(exc)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException as exc:  # re-raised on the training thread by drain()
                self.errors.append(exc)

    def release(self) -> None:
        """Stop after the jobs already submitted (the ``None`` is read after them) and wait."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def drain(self) -> None:
        """Wait for every job and stop the thread; re-raise the first error a job met."""
        self.release()
        if self.errors:
            first = self.errors[0]
            self.errors.clear()
            raise first
