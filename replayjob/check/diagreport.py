"""The result of a diag-diff: counts, the first divergent row, the first rows' drift counts and the
last row's summary, rendered as a human report or as one JSON document.

JSON output is strict JSON: non-finite numbers (a NaN leaf, an infinite difference) are written
as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from replayjob.check.leafdiff import Drift, Tolerance

SCHEMA = "replayjob.diag_diff/1"
_KIND_LABEL = {"value": "differs", "type": "type change", "only_in_a": "only in a", "only_in_b": "only in b"}


@dataclass
class RowDivergence:
    """One aligned row: its position, step and lines, and how it differs."""

    row: int
    step: Any
    line_a: int | None
    line_b: int | None
    kind: str  # "leaves" | "only_in_a" | "only_in_b"
    diverging_leaves: int
    top: list[Drift]

    @property
    def where(self) -> str:
        """``step N`` when rows carry steps, else ``row N``."""
        return f"step {self.step}" if self.step is not None else f"row {self.row}"

    def label(self) -> str:
        la = "-" if self.line_a is None else self.line_a
        lb = "-" if self.line_b is None else self.line_b
        return f"{self.where} (line {la} / {lb})"

    def to_json(self) -> dict[str, Any]:
        return {"row": self.row, "step": self.step, "line_a": self.line_a, "line_b": self.line_b,
                "kind": self.kind, "diverging_leaves": self.diverging_leaves,
                "top": [_drift_json(d) for d in self.top]}


@dataclass
class DiffReport:
    a: str
    b: str
    tol: Tolerance
    ignore: tuple[str, ...]
    top_n: int
    aligned_by: str
    rows_a: int = 0
    rows_b: int = 0
    rows_compared: int = 0
    rows_diverging: int = 0
    rows_only_in_a: int = 0
    rows_only_in_b: int = 0
    first: RowDivergence | None = None
    first_rows: list[RowDivergence] = field(default_factory=list)
    last_row: RowDivergence | None = None
    leaves_compared: bool = False  # some leaf (not ignored, not the empty row itself) was compared

    @property
    def equal(self) -> bool:
        return self.first is None

    @property
    def exit_code(self) -> int:
        return 0 if self.equal else 1

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "a": self.a, "b": self.b, "equal": self.equal,
            "rtol": self.tol.rtol, "atol": self.tol.atol, "ignore": list(self.ignore),
            "aligned_by": self.aligned_by, "rows_a": self.rows_a, "rows_b": self.rows_b,
            "rows_compared": self.rows_compared, "rows_diverging": self.rows_diverging,
            "rows_only_in_a": self.rows_only_in_a, "rows_only_in_b": self.rows_only_in_b,
            "first_divergence": self.first.to_json() if self.first else None,
            "first_diverging_rows": [r.to_json() for r in self.first_rows],
            "last_row": self.last_row.to_json() if self.last_row else None,
        }

    def render(self) -> str:
        head = "EQUAL" if self.equal else "DRIFT"
        lines = [f"diag-diff {head}: {self.a} vs {self.b}",
                 f"  aligned by {self.aligned_by}; rtol {self.tol.rtol:g}, atol {self.tol.atol:g}; "
                 f"{len(self.ignore)} ignore pattern(s)",
                 f"  rows: {self.rows_compared} compared, {self.rows_diverging} diverging, "
                 f"{self.rows_only_in_a} only in a ({self.rows_a} total), "
                 f"{self.rows_only_in_b} only in b ({self.rows_b} total)"]
        if self.first is not None:
            lines.append(f"first divergent row: {_describe(self.first)}")
            lines.extend(_drift_table(self.first.top))
            lines.append("diverging leaves per row (first diverging rows): "
                         + ", ".join(f"{r.where}: {_count(r)}" for r in self.first_rows))
        if self.last_row is not None and self.last_row is not self.first:
            lines.append(f"last compared row: {_describe(self.last_row)}")
            lines.extend(_drift_table(self.last_row.top))
        return "\n".join(lines)


def _count(r: RowDivergence) -> str:
    return r.kind.replace("_", " ") if r.kind != "leaves" else str(r.diverging_leaves)


def _describe(r: RowDivergence) -> str:
    if r.kind == "only_in_a":
        return f"{r.label()}: row present only in a"
    if r.kind == "only_in_b":
        return f"{r.label()}: row present only in b"
    return f"{r.label()}: {r.diverging_leaves} diverging leaves"


def _drift_table(drifts: list[Drift]) -> list[str]:
    if not drifts:
        return []
    width = min(max(len(d.path) for d in drifts), 60)
    out = [f"    {'leaf':<{width}}  {'a':>22}  {'b':>22}  |a-b|"]
    for d in drifts:
        diff = _KIND_LABEL[d.kind] if d.abs_diff is None else f"{d.abs_diff:.6g}"
        out.append(f"    {d.path:<{width}}  {_fmt(d.a, d.kind == 'only_in_b'):>22}  "
                   f"{_fmt(d.b, d.kind == 'only_in_a'):>22}  {diff}")
    return out


def _fmt(v: Any, missing: bool) -> str:
    if missing:
        return "(missing)"
    if isinstance(v, float):
        return f"{v:.10g}"
    text = json.dumps(v, allow_nan=True, ensure_ascii=False)
    if not text.isprintable():  # a bidi control or a C1 control JSON leaves as is: escaped, never printed raw
        text = json.dumps(v, allow_nan=True, ensure_ascii=True)
    return text if len(text) <= 22 else text[:19] + "..."


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def _drift_json(d: Drift) -> dict[str, Any]:
    return {"path": d.path, "kind": d.kind, "a": _finite(d.a), "b": _finite(d.b),
            "abs_diff": _finite(d.abs_diff)}
