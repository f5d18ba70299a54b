"""What a producer's replay provides to the driver: its trainer, stood at the captured step.

:class:`Session` is the protocol (a base class with the defaults); the driver
(:mod:`replayjob.producers.driver`) calls, in this order: :meth:`Session.restore` (the captured
start state), :meth:`~Session.plan` once, then per update :meth:`~Session.begin`, one
:meth:`~Session.micro_batch` per planned :class:`MicroStep` (with a ``before_loss`` callback the
producer calls immediately before its loss: the driver restores the captured RNG state there),
:meth:`~Session.finish` (the producer's own clip, optimizer step, scheduler step and zero-grad, once),
and after the first update :meth:`~Session.save_adapter`, :meth:`~Session.runtime` and
:meth:`~Session.document`.  In-process repeats call ``restore``, ``begin``, ``micro_batch`` and
``finish`` again from the same captured state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from replayjob.runtime import knobs

if TYPE_CHECKING:
    import torch


@dataclass
class MicroStep:
    """One micro-batch of the update as the session runs it.

    ``rows``: the logical rows it holds, in order (a trace keys its records by them, so arms that
    re-split rows compare row by row); ``rng``: the Torch RNG state restored right before its loss
    call (``None``: the stream continues from the previous micro-batch); ``data``: the producer's own;
    ``trace_ids`` and ``trace_mask``: the ``input_ids`` the model's root module receives and the
    producer's token mask over them (``[rows, length]``, nonzero where a token is real), or ``None``
    when the producer cannot be traced; ``trace_offsets``: for a micro-batch whose rows the model receives
    packed into one sequence (``trace_ids`` ``[1, length]``), where each row's tokens lie in it (``rows + 1``
    increasing offsets: row ``j`` is ``[offsets[j], offsets[j + 1])``; anything after the last offset is padding
    the model also receives), else ``None``."""

    rows: tuple[int, ...]
    rng: dict[str, torch.Tensor] | None
    data: Any
    trace_ids: torch.Tensor | None = None
    trace_mask: torch.Tensor | None = None
    trace_offsets: torch.Tensor | None = None


@dataclass
class Outcome:
    """One update's result as the producer reports it."""

    loss: float
    grad_norm: float
    backward_wall_s: float = 0.0
    forward_wall_s: float | None = None  # None: the driver's loop time less backward
    optimizer_wall_s: float | None = None  # None: the driver's time around finish()


class Session:
    """A producer's trainer rebuilt from a verified capture (see the module docstring)."""

    framework: str = ""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    #: why this producer cannot run a traced replay or in-process repeats here (None: it can)
    trace_refusal: str | None = None
    repeat_refusal: str | None = None

    def trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The trainable parameters, in the captured order."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def restore(self) -> None:
        """Load the captured start state: adapter weights, optimizer (and LR-scheduler) state."""
        raise NotImplementedError

    def plan(self) -> list[MicroStep]:
        """The micro-batches the update runs, in order."""
        raise NotImplementedError

    def begin(self, n_micro_batches: int) -> None:
        """Before an update's first micro-batch (zero gradients, reset the step's sums)."""

    def micro_batch(self, i: int, step: MicroStep, before_loss: Callable[[], None]) -> None:
        """Forward, loss and backward of micro-batch ``i``; ``before_loss()`` right before the loss call."""
        raise NotImplementedError

    def finish(self) -> Outcome:
        """The producer's clip, optimizer step, scheduler step and zero-grad, once; the step's loss and norm."""
        raise NotImplementedError

    def save_adapter(self, out: Path) -> Path | None:
        """Write the adapter after the update under ``out``; its file (``None`` on a rank that writes nothing)."""
        raise NotImplementedError

    def runtime(self, plan: list[MicroStep]) -> knobs.Runtime:
        """What the producer's knobs are observed from after the update (the built model by default)."""
        return knobs.Runtime(self.model, tuple(len(s.rows) for s in plan))

    def provenance(self) -> dict[str, Any]:
        """Run-time facts recorded under ``provenance`` (the device by default)."""
        return {"device": str(self.device)}

    def document(self, outcome: Outcome, plan: list[MicroStep]) -> dict[str, Any]:
        """The producer's part of ``replay_metrics.json``: the keyword arguments of
        :func:`replayjob.artifacts.metrics.replay_document` that come from its admission."""
        raise NotImplementedError

    def trace_identity(self, runtime: dict[str, Any]) -> dict[str, Any]:
        """``micro_batch_size`` and ``gradient_checkpointing`` as a trace's identity records them."""
        raise NotImplementedError

    def land(self, out: Path, metrics: dict[str, Any]) -> dict[str, Any]:
        """Over several ranks: merge every rank's figures into the root's metrics (``{}`` elsewhere)."""
        return metrics
