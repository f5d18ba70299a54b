"""Comparison of recomputed against recorded stage outputs, and the replay report.

A value matches when ``|actual - expected| <= atol + rtol * |expected|`` (the stage's tolerances
from the manifest); a NaN or infinity on either side never matches and is counted as
non-finite.  Bitwise-equal finite fields (the usual case for a clean capture) are settled by one
equality pass; anything else takes the full element-wise path.  Each stage gets one line (pass /
fail / skipped with a reason); the first failing stage in pipeline order is the first divergence,
with its first mismatching sample, field and token offset.  Skipped stages never count toward that
verdict.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


DEFAULT_EXAMPLES = 5


@dataclass
class Example:
    sample: str
    field: str
    token_offset: int | None
    expected: float
    actual: float
    abs_err: float


@dataclass
class FieldResult:
    field: str
    compared: int
    mismatches: int
    nonfinite: int
    max_abs_err: float
    examples: list[Example]


@dataclass
class StageResult:
    stage: str
    capability: str
    status: str              # pass | fail | skipped
    reason: str = ""
    fields: list[FieldResult] = field(default_factory=list)


@dataclass
class Report:
    bundle_id: str
    kind: str
    path: str
    identity: dict[str, Any]
    selection: dict[str, Any]
    stages: list[StageResult]

    @property
    def first_divergent(self) -> StageResult | None:
        return next((s for s in self.stages if s.status == "fail"), None)

    @property
    def diverged(self) -> bool:
        return self.first_divergent is not None

    def to_json(self) -> dict[str, Any]:
        first = self.first_divergent
        detail = None
        if first is not None:
            fr = next(f for f in first.fields if f.mismatches)
            detail = {"stage": first.stage, "field": fr.field, **(asdict(fr.examples[0]) if fr.examples else {})}
        return {"bundle_id": self.bundle_id, "kind": self.kind, "path": self.path, "identity": self.identity,
                "selection": self.selection, "verdict": "diverged" if first else "pass",
                "first_divergence": detail, "stages": [asdict(s) for s in self.stages]}


def compare(name: str, expected: Tensor, actual: Tensor, sample_ids: list[str], atol: float, rtol: float,
            max_examples: int = DEFAULT_EXAMPLES) -> FieldResult:
    """Compare one field; ``expected``/``actual`` are ``[]`` (scalar), ``[N]`` or ``[N, T]``."""
    import torch
    e = expected.to(torch.float64)
    a = actual.to(torch.float64)
    if e.shape != a.shape:
        return FieldResult(name, int(e.numel()), int(max(e.numel(), a.numel())), 0, float("inf"),
                           [])
    if torch.equal(a, e) and math.isfinite(float(e.sum())):  # bitwise equal and finite: one read each
        return FieldResult(name, int(e.numel()), 0, 0, 0.0, [])
    err = torch.sub(a, e).abs_()
    finite = torch.isfinite(err)  # |a - e| is finite exactly when both sides are
    tol = e.abs().mul_(rtol).add_(atol) if rtol else atol
    bad_mask = torch.logical_not(torch.le(err, tol).logical_and_(finite))
    mismatches = int(bad_mask.sum())
    nonfinite = int(err.numel() - int(finite.sum()))
    if nonfinite == 0:
        max_err = float(err.max()) if err.numel() else 0.0
    else:
        max_err = float(err[finite].max()) if bool(finite.any()) else 0.0
    examples = []
    bad = bad_mask.nonzero(as_tuple=False) if mismatches else torch.zeros((0, max(e.dim(), 1)), dtype=torch.int64)
    for pos in bad[:max_examples].tolist():
        if e.dim() == 0:
            who, tok = "<cohort>", None
        else:
            who = sample_ids[pos[0]] if pos[0] < len(sample_ids) else f"<cohort {pos[0]}>"
            tok = pos[1] if len(pos) > 1 else None
        ex, ac = float(e[tuple(pos)]), float(a[tuple(pos)])
        examples.append(Example(who, name, tok, ex, ac, abs(ac - ex)))
    return FieldResult(name, int(e.numel()), mismatches, nonfinite, max_err, examples)


def _fmt(x: float | None) -> str:
    return "-" if x is None else repr(x)


def render(report: Report) -> str:
    """The human form: a headline, one line per stage, examples under failing stages."""
    ident = report.identity
    step = f" step {ident['rollout_id']}:{ident['step_id']}" if ident.get("step_id") is not None else ""
    first = report.first_divergent
    head = f"bundle {report.bundle_id} ({report.kind}, rollout {ident['rollout_id']}{step}) — "
    head += f"first divergent stage: {first.stage}" if first else "all recomputed stages pass"
    lines = [head]
    sel = report.selection
    if sel.get("partial"):
        lines.append(f"selection: {sel['rows']} of {sel['total']} sample(s) (whole groups)")
    for s in report.stages:
        if s.status == "skipped":
            lines.append(f"[{'skipped':>7}] {s.stage} — {s.reason}")
            continue
        summary = ", ".join(f"{f.field}: {f.mismatches}/{f.compared} mismatched, max_abs_err {f.max_abs_err:.3g}"
                            + (f", {f.nonfinite} non-finite" if f.nonfinite else "") for f in s.fields)
        lines.append(f"[{s.status:>7}] {s.stage} — {summary}")
        if s.status == "fail":
            for f in s.fields:
                for ex in f.examples:
                    where = f" token {ex.token_offset}" if ex.token_offset is not None else ""
                    lines.append(f"          {ex.field} {ex.sample}{where}: expected={_fmt(ex.expected)} "
                                 f"actual={_fmt(ex.actual)} abs_err={ex.abs_err:.6g}")
    return "\n".join(lines)
