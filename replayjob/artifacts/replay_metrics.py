"""``replay_metrics.json`` (schema ``replayjob.replay_metrics/v2``, docs/replay-metrics.md), declared.

Every key the one replay driver writes (:mod:`replayjob.producers.driver`, for every producer) is declared
here with its type and range, and nothing else is read: an unknown key, a missing one, a bool or float where
a count is declared, a digest that is not 64 lower-case hex digits, a negative time or a share above 1 is
refused by :func:`replayjob.declaration.decode` naming the file and the field.  The rules that tie
the document to the files beside it (rank files, the final adapter, the trace index, the knob registry) are
:func:`replayjob.artifacts.metrics.read_replay`'s, which reads through this declaration first.

Three blocks are opaque on purpose and said so in :data:`OPAQUE`: recorded for people or compared whole,
never decided on field by field.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec

from replayjob.artifacts.contention import ContentionRecord
from replayjob.declaration import Count, Digest, Document, Finite, Int, NonNegative, Share, Text, whole

Scalar = str | bool | Int | Finite | None
"""A knob's value as the replay config sets it (compared whole with the arm's intent and the runtime's)."""
DigestOrEmpty = Annotated[str, whole("([0-9a-f]{64})?")]
"""A pin that may be unset (``""``: no tolerance or budget file was pinned)."""
ARM_NAME_PATTERN = r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?"  # matched whole (re.fullmatch, whole())
ArmName = Annotated[str, whole(ARM_NAME_PATTERN)]
"""An arm's name: printed in verdicts, reports and terminals, so printable ASCII only: no control character (no
newline, no escape sequence) and none that is invisible or turns the text around (a zero-width space, a
right-to-left override), which would show one arm under another's name; no space at either end (``" "`` prints
blank, ``"a "`` as ``"a"``); :data:`ARM_NAME_RULE` says it in words."""
ARM_NAME_RULE = ("a non-empty name of printable ASCII characters: no control characters (newlines, tabs, escape "
                 "sequences), no invisible or direction-changing ones, and no space at either end")


class Pins(Document, frozen=True):
    expected_logical_sha256: Digest
    expected_manifest_sha256: Digest
    payload_spans_sha256: Digest


class Timing(Document, frozen=True):
    """The update's wall time and its parts, each measured inside it: no part is longer than the whole (also
    when merged over ranks, each figure the slowest rank's)."""

    local_train_wall_s: NonNegative
    forward_wall_s: NonNegative
    backward_wall_s: NonNegative
    optimizer_wall_s: NonNegative

    def __post_init__(self) -> None:
        for name in ("forward_wall_s", "backward_wall_s", "optimizer_wall_s"):
            if not _within(getattr(self, name), self.local_train_wall_s):
                raise ValueError(f"`{name}` ({getattr(self, name)!r} s) is longer than the update it is part of "
                                 f"(`local_train_wall_s`, {self.local_train_wall_s!r} s)")

    def parts_fit(self) -> None:
        """One process's timing: its parts, measured one after the other inside the update, add up to no more
        than it (merged over ranks they need not: each part is the slowest rank's)."""
        parts = self.forward_wall_s + self.backward_wall_s + self.optimizer_wall_s
        if not _within(parts, self.local_train_wall_s):
            raise ValueError(f"forward, backward and optimizer times add up to {parts!r} s, more than the update "
                             f"they are parts of (`local_train_wall_s`, {self.local_train_wall_s!r} s)")


def _within(part: float, whole: float) -> bool:
    """``part <= whole`` but for the rounding of sums of clock differences."""
    return part <= whole * (1 + 1e-9) + 1e-9


class Memory(Document, frozen=True):
    peak_bytes: Count
    kind: Literal["max_rss", "cuda_max_allocated"]


class Padding(Document, frozen=True):
    """Token positions of the update's micro-batches: ``real_tokens`` of ``padded_tokens`` (every position after
    padding); ``padding_fraction`` summarises them (``1 - real / padded``, 0 with no position)."""

    real_tokens: Count
    padded_tokens: Count
    padding_fraction: Share
    micro_batches: Count

    def __post_init__(self) -> None:
        if self.real_tokens > self.padded_tokens:
            raise ValueError(f"`real_tokens` ({self.real_tokens}) cannot exceed `padded_tokens` "
                             f"({self.padded_tokens}), every position after padding")
        fraction = 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0
        if abs(self.padding_fraction - fraction) > 1e-12:  # each producer divides its own way: rounding apart
            raise ValueError(f"`padding_fraction` is {self.padding_fraction!r}, but what it summarises gives "
                             f"{fraction!r}")


class Slot(Document, frozen=True):
    design: Text
    seed: Count
    block: Count
    position: Count


class InProcess(Document, frozen=True):
    warmup_updates: Annotated[int, msgspec.Meta(ge=0, le=10_000)]
    measured_updates: Annotated[int, msgspec.Meta(ge=1, le=10_000)]
    local_train_wall_s: Annotated[list[NonNegative], msgspec.Meta(min_length=1)]
    peak_bytes: list[Count]
    loss_equal: bool

    def __post_init__(self) -> None:
        if not len(self.local_train_wall_s) == len(self.peak_bytes) == self.measured_updates:
            raise ValueError("`local_train_wall_s` and `peak_bytes` hold one value per measured update "
                             "(`measured_updates`)")


class TracePin(Document, frozen=True):
    index_path: Literal["trace/index.json"]
    index_sha256: Digest


class RoutingPin(Document, frozen=True):
    path: Literal["routing.safetensors"]
    sha256: Digest


class RankEntry(Document, frozen=True):
    rank: Count
    file: Text
    sha256: Digest
    rows: list[Count]


class Distributed(Document, frozen=True):
    world_size: Annotated[int, msgspec.Meta(ge=2, le=1 << 20)]
    strategy: Text
    sharding: Text
    ranks: list[RankEntry]

    def __post_init__(self) -> None:
        if [e.rank for e in self.ranks] != list(range(self.world_size)):
            raise ValueError("`ranks` holds one entry per rank 0..world_size-1, in rank order")
        end = 0
        for e in self.ranks:  # the ranks' shares tile the rows from 0, in rank order
            if len(e.rows) != 2 or e.rows[0] != end or e.rows[1] < e.rows[0]:
                raise ValueError(f"`ranks[{e.rank}].rows` is {e.rows}: each rank's rows are [first, end), "
                                 f"starting where the previous rank's end ({end})")
            end = e.rows[1]


class RankMetrics(Document, frozen=True):
    """One rank's figures of a replay over several ranks (``replay_metrics.rank-<r>.json``, schema
    ``replayjob.replay_rank_metrics/v1``), as the replay writes them and :func:`replayjob.artifacts.metrics.merge_ranks`
    merges them."""

    schema: Literal["replayjob.replay_rank_metrics/v1"]
    rank: Count
    world_size: Annotated[int, msgspec.Meta(ge=2, le=1 << 20)]
    arm: ArmName
    repeat_index: Count
    rows: Annotated[list[Count], msgspec.Meta(min_length=2, max_length=2)]
    shard_logical_sha256: Digest
    shard_effective_rows_sha256: Digest
    loss: Finite | None  # this rank's entry of the replay's loss (the entries' sum in rank order); null: not finite
    micro_batch_rows: list[Count]
    timing: Timing
    memory: Memory
    padding: Padding
    host: dict[Text, str | None]

    def __post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"`rank` {self.rank} is not below `world_size` {self.world_size}")
        if self.rows[0] > self.rows[1]:
            raise ValueError(f"`rows` {self.rows} must be [first, end) with first <= end")
        self.timing.parts_fit()
        if sum(self.micro_batch_rows) != self.rows[1] - self.rows[0]:  # the rank's micro-batches hold its share
            raise ValueError(f"`micro_batch_rows` {self.micro_batch_rows} add up to {sum(self.micro_batch_rows)} "
                             f"rows, but the rank's share `rows` {self.rows} holds {self.rows[1] - self.rows[0]}")


class ReplayMetrics(Document, frozen=True, kw_only=True):
    """One replay's evidence, as the replay driver writes it."""

    OPAQUE: ClassVar[dict[str, str]] = {
        "provenance": "determinism provenance, recorded for people (the gate decides on runtime and host)",
        "rows": "the producer's own row and token counts, recorded for people (each producer counts its own "
                "way); the one the gate reads, rows.rows, is checked by the reader",
        "knobs": "the arm's knob values as set, compared whole with the arm's intent",
    }

    schema: Literal["replayjob.replay_metrics/v2"]
    framework: Text
    replayjob_version: Text
    torch_version: Text
    device: Text
    arm: ArmName
    repeat_index: Count
    step: Count  # the captured step this update replays (its capture manifest's `step`)
    pins: Pins
    logical: Digest = msgspec.field(name="optimizer/logical_batch_sha256")
    effective: Digest = msgspec.field(name="optimizer/local_effective_rows_sha256")
    manifest: Digest = msgspec.field(name="optimizer_batch/manifest_sha256")
    initial_adapter: Digest = msgspec.field(name="optimizer_batch/initial_adapter_sha256")
    final_adapter: Digest = msgspec.field(name="optimizer_batch/final_adapter_sha256")
    final_adapter_path: Text
    allowed_config_differences: list[Text]
    observed_config_differences: list[Text]
    knobs: dict[str, Any]
    skipped: list[Text]
    runtime: dict[Text, Scalar]
    loss: Finite | None  # null: not finite (named in nonfinite_outcome)
    grad_norm: NonNegative | None  # null: not finite (named in nonfinite_outcome)
    nonfinite_outcome: Annotated[list[Literal["grad_norm", "loss"]], msgspec.Meta(max_length=2)] = (
        msgspec.field(default_factory=list))
    timing: Timing
    memory: Memory
    padding: Padding
    rows: dict[str, Any]
    rng_restored: list[Text]
    tolerances_sha256: DigestOrEmpty
    budgets_sha256: DigestOrEmpty
    config_sha256: Digest
    host: dict[Text, str | None]
    provenance: dict[str, Any]
    schedule: Slot | None = None
    in_process: InProcess | None = None
    contention: ContentionRecord | None = None
    wall_s: NonNegative
    trace: TracePin | None = None
    routing: RoutingPin | None = None
    distributed: Distributed | None = None

    def __post_init__(self) -> None:
        """The device, told four ways, is one: the replay's ``device``, the host's ``device_type``, the memory
        measure's kind (CUDA's allocator peak only on a CUDA device) and the contention record's device."""
        named = self.nonfinite_outcome
        if named != sorted(set(named)):
            raise ValueError(f"`nonfinite_outcome` {named} must name each of grad_norm and loss at most once, sorted")
        if (self.loss is None) != ("loss" in named):
            raise ValueError("`loss` is null exactly when `nonfinite_outcome` names it (a non-finite loss), but "
                             f"`loss` is {self.loss!r} and `nonfinite_outcome` is {named}")
        if (self.grad_norm is None) != ("grad_norm" in named):  # every producer reports a norm: null is not finite
            raise ValueError("`grad_norm` is null exactly when `nonfinite_outcome` names it (a non-finite norm; every "
                             f"producer reports one), but `grad_norm` is {self.grad_norm!r} and `nonfinite_outcome` is "
                             f"{named}")
        kind = self.device.split(":", 1)[0]
        host = self.host.get("device_type")
        if host is not None and host != kind:
            raise ValueError(f"`host.device_type` is {host!r}, but the replay ran on `device` {self.device!r}")
        if (self.memory.kind == "cuda_max_allocated") != (kind == "cuda"):
            raise ValueError(f"`memory.kind` {self.memory.kind!r} does not belong to `device` {self.device!r} "
                             "(cuda_max_allocated is CUDA's allocator peak, max_rss the process's on a CPU)")
        if self.distributed is None:  # one process: its own clock, its parts inside its update, inside its run
            self.timing.parts_fit()
            if not _within(self.timing.local_train_wall_s, self.wall_s):
                raise ValueError(f"`wall_s` ({self.wall_s!r} s), the whole replay, is shorter than its update "
                                 f"(`timing.local_train_wall_s`, {self.timing.local_train_wall_s!r} s)")
        if self.contention is not None and self.contention.device != self.device:
            raise ValueError(f"`contention.device` is {self.contention.device!r}, but the replay ran on `device` "
                             f"{self.device!r}")
        if self.contention is not None and not _within(self.contention.wall_s, self.wall_s):
            raise ValueError(f"`contention.wall_s` ({self.contention.wall_s!r} s), the probe's window inside the "
                             f"replay, is longer than the whole replay (`wall_s`, {self.wall_s!r} s)")
