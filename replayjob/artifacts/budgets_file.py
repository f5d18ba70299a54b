"""The performance budget file (docs/verdict-format.md, "Budgets"), declared.

A TOML file pinned by SHA-256 in every replay (``[optimizer_batch] budgets_sha256``) before the runs: optional
top-level ``baseline`` and ``allow_cross_node``, then one table per arm of ``metric = { max_ratio = X,
min_ratio = Y }`` (:class:`ArmBounds`, :class:`RatioBounds`).  A TOML file's arms are tables under keys of the
user's choosing, so :func:`shaped` gathers them under one declared field, ``arms``, before decoding: a top-level
key that is neither ``baseline``, ``allow_cross_node`` nor a table is an unknown key.  What the bounds mean and
how they are decided is :mod:`replayjob.gate.budgets`.

Example:
    >>> from replayjob.declaration import decode
    >>> doc = decode(shaped({"mb-1": {"local_train_wall_s": {"max_ratio": 2.0}}}), BudgetsFile, where="b.toml")
    >>> doc.arms["mb-1"].local_train_wall_s
    RatioBounds(max_ratio=2.0, min_ratio=UNSET)
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

from replayjob.declaration import Document, Text

TIME_METRICS = ("local_train_wall_s", "forward_wall_s", "backward_wall_s", "optimizer_wall_s",
                "in_process_train_wall_s")
MEMORY_METRIC = "peak_memory_bytes"
METRICS = (*TIME_METRICS, MEMORY_METRIC)
KINDS = ("max_ratio", "min_ratio")
TOP_LEVEL = ("baseline", "allow_cross_node")
HINT = "e.g. [ckpt-on] local_train_wall_s = { max_ratio = 1.35 } (docs/verdict-format.md)"

Ratio = Annotated[float, msgspec.Meta(gt=0.0, le=sys.float_info.max)]
"""A bound on a ratio: a positive finite number (an integer is read as a float; a bool or a string is refused)."""


class RatioBounds(Document, frozen=True):
    """One metric's bounds: ``max_ratio`` and/or ``min_ratio``, the lower not above the upper (an absent bound is
    ``UNSET``: TOML has no null, and a null is refused like any value that is not a positive finite number)."""

    max_ratio: Ratio | UnsetType = UNSET
    min_ratio: Ratio | UnsetType = UNSET

    def __post_init__(self) -> None:
        if self.max_ratio is UNSET and self.min_ratio is UNSET:
            raise ValueError("declares no bound: give max_ratio and/or min_ratio")
        if isinstance(self.max_ratio, float) and isinstance(self.min_ratio, float) and self.min_ratio > self.max_ratio:
            raise ValueError(f"min_ratio {self.min_ratio} is above max_ratio {self.max_ratio}: the bounds "
                             "contradict each other, so no measurement could decide them")

    def limits(self) -> list[tuple[str, float]]:
        """(kind, limit) of each declared bound, in :data:`KINDS` order."""
        return [(k, v) for k in KINDS if isinstance(v := getattr(self, k), float)]


class ArmBounds(Document, frozen=True):
    """One arm's table: a :class:`RatioBounds` per bounded metric (:data:`METRICS`), at least one."""

    local_train_wall_s: RatioBounds | UnsetType = UNSET
    forward_wall_s: RatioBounds | UnsetType = UNSET
    backward_wall_s: RatioBounds | UnsetType = UNSET
    optimizer_wall_s: RatioBounds | UnsetType = UNSET
    in_process_train_wall_s: RatioBounds | UnsetType = UNSET
    peak_memory_bytes: RatioBounds | UnsetType = UNSET

    def __post_init__(self) -> None:
        if not self.metrics():
            raise ValueError("bounds no metric: write metric = { max_ratio = X } entries (metrics: "
                             + ", ".join(METRICS) + ")")

    def metrics(self) -> list[tuple[str, RatioBounds]]:
        """(metric, bounds) of each bounded metric, in :data:`METRICS` order."""
        return [(m, b) for m in METRICS if isinstance(b := getattr(self, m), RatioBounds)]

    def bounds(self, metric: str) -> RatioBounds:
        """The bounds declared on ``metric`` (one this arm bounds)."""
        got = getattr(self, metric)
        assert isinstance(got, RatioBounds), metric
        return got


class BudgetsFile(Document, frozen=True):
    """A budget file: the baseline it may name, whether pairs may span nodes, and its arms' bounds."""

    arms: dict[Text, ArmBounds]
    baseline: Text | None = None
    allow_cross_node: bool | UnsetType = UNSET  # absent: false

    @property
    def cross_node(self) -> bool:
        """``allow_cross_node``, false when absent."""
        return self.allow_cross_node is True

    def __post_init__(self) -> None:
        if not self.arms:
            raise ValueError("the budget file declares no bound")


def shaped(doc: dict[str, Any]) -> dict[str, Any]:
    """A parsed budget file as :class:`BudgetsFile` reads it: :data:`TOP_LEVEL` keys and any key whose value is
    not a table stay at the top (where an unknown one is refused), every other table is an arm under ``arms``."""
    top = {k: v for k, v in doc.items() if k in TOP_LEVEL or not isinstance(v, dict)}
    if "arms" in top:  # `arms = 3`: refused as the declared field it would shadow, never dropped
        return top
    return {**top, "arms": {k: v for k, v in doc.items() if k not in top}}


assert tuple(f for f in ArmBounds.__struct_fields__) == METRICS
assert RatioBounds.__struct_fields__ == KINDS
