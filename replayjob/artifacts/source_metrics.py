"""The source run's ``metrics.json`` (docs/replay-metrics.md, "The source run's metrics.json"), declared.

Three writers fill it (:mod:`replayjob.artifacts.metrics` names every key): the built-in trainer
(``source_document``) and what its capture hooks add (a one-step capture's pins, the chosen steps' records, the
ring buffer's figures and records, an MoE model's routing files), and the capture API (``capture_document`` for
one step, ``steps_document`` for several).  :class:`SourceMetrics` declares the union of their keys, each typed
and ranged, none unknown; the two forms ``reduce --source`` compares with are its rules:

* **one step** (no ``--source-step``): the pins, the final adapter's file and the loss
  (:meth:`SourceMetrics.one_step_missing` names what such a file lacks);
* **a step record** (``--source-step K``): an entry of ``optimizer_batch/steps`` or of the ring's ``written``
  (:class:`StepRecord`), in ascending step order in each list.

The paths it names are checked against the file system by the reader (inside the run directory, no symbolic
link on the way: :func:`replayjob.artifacts.metrics.read_source`).
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import UNSET, UnsetType

from replayjob.declaration import Count, Digest, Document, Finite, Int, NonNegative, Positive, Text, whole

BareName = Annotated[str, whole(r"(?!\.\.?\Z)[A-Za-z0-9_.-]+")]
"""A file name in the metrics file's own directory (no separator, not ``.`` or ``..``)."""


def _ascending(field: str, steps: list[int]) -> None:
    if any(b <= a for a, b in itertools.pairwise(steps)):
        raise ValueError(f"`{field}` must list distinct steps in ascending order, found steps {steps}")


class StepRecord(Document, frozen=True):
    """One captured step's record (``metrics.step_record``): its manifest and pins, its adapters, its replay
    config, and the loss and gradient norm the trainer reported (null when not finite or not recorded)."""

    step: Count
    manifest_path: Text
    manifest_sha256: Digest
    logical_batch_sha256: Digest
    local_effective_rows_sha256: Digest
    initial_adapter_sha256: Digest
    final_adapter_sha256: Digest | None  # null: the step's update never returned
    replay_config: Text
    nonfinite_inputs: bool
    loss: Finite | None = None
    grad_norm: NonNegative | None = None


class RoutingStep(Document, frozen=True):
    """An MoE model's routing file of one captured step (docs/moe.md)."""

    step: Count
    path: Text
    sha256: Digest


class RingTrigger(Document, frozen=True):
    """What fired the ring buffer's write: the step and the reason."""

    step: Count
    reason: Text


class Ring(Document, frozen=True):
    """The ring buffer's figures and the steps it wrote (docs/optimizer-batch.md)."""

    size: Positive
    steps_observed: Count
    peak_bytes: Count
    training_thread_s: NonNegative
    trigger: RingTrigger | None
    written: list[StepRecord]

    def __post_init__(self) -> None:
        _ascending("written", [e.step for e in self.written])


class SourceMetrics(Document, frozen=True):
    """``metrics.json`` of a source run or a capture: every key any of its writers writes."""

    OPAQUE: ClassVar[dict[str, str]] = {
        "config": "the run's resolved config as its producer records it (each producer's own keys), read by the "
                  "gate for the values it compares with a replay's",
        "provenance": "the trainer's record of how it ran (determinism settings, device), kept for people",
    }
    ONE_STEP: ClassVar[tuple[str, ...]] = (
        "logical", "effective", "manifest", "initial_adapter", "final_adapter", "final_adapter_path", "loss",
        "manifest_path")

    schema: Literal["replayjob.metrics/v1"]
    config: dict[str, Any]
    trainer: Text | UnsetType = UNSET  # the built-in trainer
    framework: Text | UnsetType = UNSET  # the capture API: the producer
    replayjob_version: Text | UnsetType = UNSET
    torch_version: Text | UnsetType = UNSET
    device: Text | UnsetType = UNSET
    steps_run: Count | UnsetType = UNSET
    last_step: Int | UnsetType = UNSET
    step: Count | UnsetType = UNSET
    loss: Finite | UnsetType | None = UNSET
    grad_norm: NonNegative | UnsetType | None = UNSET
    initial_adapter_sha256: Digest | UnsetType | None = UNSET
    final_adapter_sha256: Digest | UnsetType = UNSET  # the trainer's own record of its final adapter
    final_adapter_path: Text | UnsetType = UNSET
    config_sha256: Digest | UnsetType = UNSET
    provenance: dict[str, Any] | UnsetType = UNSET
    wall_s: NonNegative | UnsetType = UNSET
    logical: Digest | UnsetType = msgspec.field(default=UNSET, name="optimizer/logical_batch_sha256")
    effective: Digest | UnsetType = msgspec.field(default=UNSET, name="optimizer/local_effective_rows_sha256")
    manifest: Digest | UnsetType = msgspec.field(default=UNSET, name="optimizer_batch/manifest_sha256")
    initial_adapter: Digest | UnsetType = msgspec.field(default=UNSET, name="optimizer_batch/initial_adapter_sha256")
    final_adapter: Digest | UnsetType = msgspec.field(default=UNSET, name="optimizer_batch/final_adapter_sha256")
    manifest_path: BareName | UnsetType = msgspec.field(default=UNSET, name="optimizer_batch/manifest_path")
    steps: list[StepRecord] | UnsetType = msgspec.field(default=UNSET, name="optimizer_batch/steps")
    steps_not_captured: list[Count] | UnsetType = msgspec.field(default=UNSET,
                                                                name="optimizer_batch/steps_not_captured")
    ring: Ring | UnsetType = msgspec.field(default=UNSET, name="optimizer_batch/ring")
    routing: list[RoutingStep] | UnsetType = msgspec.field(default=UNSET, name="routing/steps")

    def __post_init__(self) -> None:
        """The records agree with each other: steps in order, a run's last step reached by its steps, and a
        one-step capture's run-level records naming the same files as its pins."""
        if not isinstance(self.steps, UnsetType):
            _ascending("optimizer_batch/steps", [e.step for e in self.steps])
            if not isinstance(self.steps_not_captured, UnsetType):
                both = sorted({e.step for e in self.steps} & set(self.steps_not_captured))
                if both:
                    raise ValueError(f"steps {both} are listed both as captured (`optimizer_batch/steps`) and as "
                                     "not captured (`optimizer_batch/steps_not_captured`)")
        if not isinstance(self.steps_not_captured, UnsetType):
            _ascending("optimizer_batch/steps_not_captured", self.steps_not_captured)
        if (not isinstance(self.steps_run, UnsetType) and not isinstance(self.last_step, UnsetType)
                and self.last_step < self.steps_run - 1):  # a run of N steps from step S >= 0 ends at S + N - 1
            raise ValueError(f"`last_step` is {self.last_step}, but a run of {self.steps_run} steps "
                             f"(`steps_run`) ends at step {self.steps_run - 1} or later")
        if isinstance(self.final_adapter, UnsetType):
            return
        # a one-step capture: the run is the captured update (its trainer refuses to capture a longer run), so
        # the run's own records and the capture's pins describe the same adapters
        if not isinstance(self.steps_run, UnsetType) and self.steps_run != 1:
            raise ValueError(f"`steps_run` is {self.steps_run}, but a one-step capture "
                             "(`optimizer_batch/final_adapter_sha256`) records a run of that one step")
        if self.final_adapter_sha256 not in (UNSET, self.final_adapter):
            raise ValueError(f"`final_adapter_sha256` ({self.final_adapter_sha256}) and "
                             f"`optimizer_batch/final_adapter_sha256` ({self.final_adapter}) both name the adapter "
                             "the run saved (`final_adapter_path`), so they must be one digest")
        if self.initial_adapter is not UNSET and self.initial_adapter_sha256 not in (UNSET, None, self.initial_adapter):
            raise ValueError(f"`initial_adapter_sha256` ({self.initial_adapter_sha256}) and "
                             f"`optimizer_batch/initial_adapter_sha256` ({self.initial_adapter}) both name the adapter "
                             "the one captured step started from, so they must be one digest")

    def records(self) -> list[tuple[str, StepRecord]]:
        """Every captured step's record with where it lies: the chosen steps, then the ring's written steps."""
        out = [(f"optimizer_batch/steps[{i}]", e) for i, e in enumerate(self.steps or ())]
        if not isinstance(self.ring, UnsetType):
            out += [(f"optimizer_batch/ring.written[{i}]", e) for i, e in enumerate(self.ring.written)]
        return out

    def one_step_missing(self) -> list[str]:
        """The keys (as the file spells them) a one-step capture records and this file lacks (a null loss
        included: the one-step form compares with a number)."""
        names = {f.name: f.encode_name for f in msgspec.structs.fields(self)}
        return [names[a] for a in self.ONE_STEP if getattr(self, a) in (UNSET, None)]
