"""``bundle replay``: resolve, validate, select, recompute every stage in order, compare, report.

Example:
    >>> report = replay_bundle("captures/update-000000-000000")    # doctest: +SKIP
    >>> report.first_divergent is None                              # doctest: +SKIP
    True
"""

from __future__ import annotations

from pathlib import Path

from replayjob.bundle import format as fmt
from replayjob.bundle.reader import Bundle, load_bundle
from replayjob.bundle.recompute import RECOMPUTE, cohort_level, take_rows
from replayjob.bundle.report import DEFAULT_EXAMPLES, FieldResult, Report, StageResult, compare
from replayjob.bundle.select import Selection, check_identity, resolve, select
from replayjob.errors import ContractError, UsageError


def replay_bundle(path: str | Path, *, stage: str = "all", samples: list[str] | None = None,
                  groups: list[str] | None = None, batches: list[str] | None = None,
                  step: str | None = None, rollout: int | None = None,
                  max_examples: int = DEFAULT_EXAMPLES) -> Report:
    """Recompute and compare; returns the report (``report.diverged`` -> exit 1), raises if refused."""
    if stage != "all" and stage not in fmt.STAGE_ORDER:
        raise UsageError(f"--stage must be 'all' or one of {list(fmt.STAGE_ORDER)}, not {stage!r}")
    step_id = fmt.parse_step(step) if step is not None else None
    target = resolve(path, step_id, rollout)
    b = load_bundle(target)
    check_identity(b, step_id, rollout)
    if stage != "all" and stage not in fmt.KIND_STAGES[b.kind]:
        raise UsageError(f"stage {stage!r} is not in a {b.kind} bundle ({list(fmt.KIND_STAGES[b.kind])})")
    sel = select(b, samples or [], groups or [], batches or [])
    results = [run_stage(b, s, sel, stage, max_examples) for s in fmt.KIND_STAGES[b.kind]]
    if all(r.status == "skipped" for r in results):  # a vacuous pass would mislead a gate
        raise ContractError("nothing to recompute: " + "; ".join(f"{r.stage} {r.reason}" for r in results),
                            where=target, hint="select a recomputable stage, or whole cohorts for loss.policy")
    ident = b.index["identity"]
    return Report(b.manifest["bundle_id"], b.kind, str(target),
                  {"rollout_id": ident["rollout_id"], "step_id": ident["step_id"], "ranks": b.ranks},
                  {"partial": sel.partial, "rows": len(sel.rows), "total": len(b.samples), **sel.requested},
                  results)


def run_stage(b: Bundle, stage: str, sel: Selection, only: str, max_examples: int) -> StageResult:
    import torch
    cap = b.capability(stage)
    if only not in ("all", stage):
        return StageResult(stage, cap, "skipped", f"not selected (--stage {only})")
    if cap != "recompute":
        why = b.manifest["stages"][stage]["reason"]
        return StageResult(stage, cap, "skipped", cap + (f": {why}" if why else ""))
    if sel.partial and cohort_level(stage, b):
        return StageResult(stage, cap, "skipped", "cohort-level stage under a partial selection: a subset "
                                                  "cannot be compared with a whole-cohort value")
    actual = RECOMPUTE[stage](b, sel.rows)
    tol = b.manifest["comparison"][stage]
    recs = b.samples
    ids = [recs[i]["sample_id"] for i in sel.rows]
    fields: list[FieldResult] = []
    for name, kind in fmt.OUTPUTS[stage].items():
        rec = b.expected[stage][name]
        if kind == "token":
            exp = take_rows(b.payloads[name], sel.rows)
        elif kind == "sample":
            exp = take_rows(torch.tensor(rec, dtype=torch.float64), sel.rows)
        else:
            exp = torch.tensor([c.loss for c in b.loss_cohorts], dtype=torch.float64)
        fields.append(compare(name, exp, actual[name], ids if kind != "scalar" else
                              [f"<rank {c.rank}>" for c in b.loss_cohorts], float(tol["atol"]),
                              float(tol["rtol"]), max_examples))
    status = "fail" if any(f.mismatches for f in fields) else "pass"
    return StageResult(stage, cap, status, "", fields)
