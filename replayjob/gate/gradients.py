"""Gradient evidence from traced replays (``replay --trace``, docs/trace-format.md) for ``reduce``.

* Approximate claim: per trainable parameter and per pair of arms, the gradient relative L2
  (``||g_i - g_j|| / max(||g_i||, ||g_j||)``) and cosine over every cross-arm pair of traced replays;
  the statistic is the median over those pairs with a seeded percentile bootstrap interval
  (replays resampled within each arm, :mod:`.stats`'s seed, resamples and confidence).  Each is
  judged against the same noise envelope as ``trace-diff`` (:mod:`replayjob.trace.envelope`):
  twice the largest within-arm (same-condition) error where repeats differ, else the rounding bound
  for the gradient's dtype and reduction length -- never a zero floor.  Relative L2 fails when the
  interval's upper end exceeds the envelope; cosine fails when its lower end is below
  ``1 - envelope**2`` (equal-norm vectors at relative distance ``e`` have ``1 - cos = e**2 / 2``).
  A NaN or an infinity in any gradient compared (or in the envelope) fails both, for that parameter
  and pair of arms: the row then holds ``null`` statistics and ``non_finite: true``.  Traces with no
  trainable parameter in common are refused: a check over nothing does not pass.
* Bitwise claim: when it fails and the differing replays are traced, the first divergent module in
  forward and backward order between the first traced replay and the first traced replay whose
  final adapter differs from it, with the per-site error curve for the report.

Traces are read against the index SHA-256 each replay_metrics.json pins and must be that replay's own (its capture,
start state, arm, repeat, device and build); a tampered or another replay's trace refuses.
"""

from __future__ import annotations

import math
from typing import Any

from replayjob.artifacts.trace_store import Trace, dtype_name
from replayjob.gate import checks as C
from replayjob.gate import stats
from replayjob.gate.evidence import Replay
from replayjob.trace.diff import Side, TraceDiff, replay_trace, rounding_scale
from replayjob.trace.envelope import cosine, envelope, finite_or_none, relative_error, rounding_bound


def _traced(replays: list[Replay]) -> list[tuple[Replay, Trace]]:
    return [(r, replay_trace(r, r.path.parent)) for r in replays if r.trace_index_sha256 is not None]


def _median_interval(values: list[list[float]]) -> tuple[float, float, float]:
    """Median over the pair grid ``values[i][j]`` and its bootstrap interval (rows and columns resampled)."""
    import numpy as np

    grid = np.asarray(values, dtype=np.float64)
    rng = np.random.RandomState(stats.BOOTSTRAP_SEED)
    n, m = grid.shape
    rows = rng.randint(0, n, size=(stats.BOOTSTRAP_RESAMPLES, n))
    cols = rng.randint(0, m, size=(stats.BOOTSTRAP_RESAMPLES, m))
    meds = np.array([np.median(grid[np.ix_(r, c)]) for r, c in zip(rows, cols, strict=True)])
    alpha = (1.0 - stats.CONFIDENCE) / 2.0
    low, high = (float(x) for x in np.quantile(meds, [alpha, 1.0 - alpha]))
    return float(np.median(grid)), low, high


def _param_rows(traced: list[tuple[Replay, Trace]], arms: dict[str, C.Arm]) -> tuple[list[dict[str, Any]],
                                                                                     list[str], list[str]]:
    by_arm: dict[str, list[Any]] = {}
    for r, t in traced:
        by_arm.setdefault(r.arm, []).append((r, t))
    names = [a for a in arms if a in by_arm]
    _, k_params, position = rounding_scale(traced[0][1])
    rows: list[dict[str, Any]] = []
    bad_rel: list[str] = []
    bad_cos: list[str] = []
    for pi, p0 in enumerate(traced[0][1].params):
        grads = {a: [t.params[pi].grad for _, t in by_arm[a]] for a in names}
        within = [relative_error(g[i], g[j]) for g in grads.values() for i in range(len(g))
                  for j in range(i + 1, len(g))]
        bound = envelope(within, None, rounding_bound(dtype_name(p0.grad.dtype), k_params, position))
        for x, ax in enumerate(names):
            for ay in names[x + 1:]:
                rel = [[relative_error(gi, gj) for gj in grads[ay]] for gi in grads[ax]]
                cos = [[cosine(gi, gj) for gj in grads[ay]] for gi in grads[ax]]
                # the non-finite marker (NaN) in any error, or in the envelope, is never within a bound
                non_finite = not math.isfinite(bound.value) or not all(
                    math.isfinite(v) for line in rel for v in line) or any(
                    c is not None and not math.isfinite(c) for line in cos for c in line)
                r_med, r_lo, r_hi = (math.nan,) * 3 if non_finite else _median_interval(rel)
                row: dict[str, Any] = {"parameter": p0.name, "arms": f"{ax} ~ {ay}", "pairs": len(rel) * len(rel[0]),
                                       "relative_l2": {"median": finite_or_none(r_med), "low": finite_or_none(r_lo),
                                                       "high": finite_or_none(r_hi)},
                                       "envelope": finite_or_none(bound.value), "envelope_source": bound.source,
                                       "cosine": None, "non_finite": non_finite}
                if non_finite:
                    bad_cos.append(f"{ax} ~ {ay}: {p0.name} (non-finite)")
                elif all(c is not None for line in cos for c in line):
                    c_med, c_lo, c_hi = _median_interval([[float(c or 0.0) for c in line] for line in cos])
                    row["cosine"] = {"median": c_med, "low": c_lo, "high": c_hi, "floor": 1.0 - bound.value ** 2}
                    if c_lo < 1.0 - bound.value ** 2:
                        bad_cos.append(f"{ax} ~ {ay}: {p0.name}")
                if non_finite or r_hi > bound.value:
                    bad_rel.append(f"{ax} ~ {ay}: {p0.name}" + (" (non-finite)" if non_finite else ""))
                rows.append(row)
    return rows, bad_rel, bad_cos


def approximate_checks(replays: list[Replay], arms: dict[str, C.Arm]) -> list[C.Check]:
    """``approximate.gradient_relative_l2`` and ``approximate.gradient_cosine`` from traced replays."""
    g = "approximate"
    names = ("approximate.gradient_relative_l2", "approximate.gradient_cosine")
    traced = _traced(replays)
    traced_arms = {r.arm for r, _ in traced}
    if len(traced_arms) < 2:
        why = ("needs traced replays (replay --trace) in at least two arms; traced arms: "
               + (", ".join(sorted(traced_arms)) or "none"))
        return [C.Check(n, g, C.NOT_APPLICABLE, None, None, why) for n in names]
    if len({tuple(p.name for p in t.params) for _, t in traced}) != 1:
        return [C.Check(n, g, C.REFUSED, "the same trainable parameters in every trace", None,
                        "traces hold different parameters: not replays of one model") for n in names]
    if not traced[0][1].params:
        return [C.Check(n, g, C.REFUSED, "the same trainable parameters in every trace", {"parameters": 0},
                        "the traces hold no trainable parameter: no gradient was compared") for n in names]
    rows, bad_rel, bad_cos = _param_rows(traced, arms)
    boot = {"seed": stats.BOOTSTRAP_SEED, "resamples": stats.BOOTSTRAP_RESAMPLES, "confidence": stats.CONFIDENCE}
    untraced = sorted(r.label for r in replays if r.trace_index_sha256 is None)
    detail = (f"median over cross-arm pairs of traced replays with a {boot['confidence']:.0%} bootstrap interval "
              f"(seed {boot['seed']}, {boot['resamples']} resamples), judged against the trace-diff noise envelope"
              + (f"; untraced replays not used: {', '.join(untraced)}" if untraced else ""))
    return [C.Check(names[0], g, C.FAIL if bad_rel else C.PASS, "upper interval end <= envelope",
                    {"parameters": rows}, detail, tuple(bad_rel)),
            C.Check(names[1], g, C.FAIL if bad_cos else C.PASS, "lower interval end >= 1 - envelope**2",
                    {"parameters": len(rows)}, detail, tuple(bad_cos))]


def localise(replays: list[Replay], source_final_adapter: str) -> list[C.Check]:
    """``bitwise.first_divergent_module`` when two traced replays' final adapters differ, else nothing.

    The reference is a traced replay that reproduced the source's final adapter when there is one
    (else the first by arm and repeat), compared with the first traced replay that differs from it.
    """
    order = sorted(replays, key=lambda r: (r.final_adapter != source_final_adapter, r.arm, r.repeat_index))
    traced = _traced(order)
    if not traced:
        return []
    first = traced[0]
    other = next(((r, t) for r, t in traced[1:] if r.final_adapter != first[0].final_adapter), None)
    if other is None:
        return []
    rep = TraceDiff([Side(first[0].path.parent, first[1])], [Side(other[0].path.parent, other[1])]).report()
    fd = rep["first_divergence"]

    def brief(r: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if r is None else {k: r[k] for k in ("name", "kind", "position", "status", "rel_l2", "envelope",
                                                         "envelope_source")}

    curve = {d: [[r["position"], r["rel_l2"], r["envelope"]] for r in rep[d]] for d in ("forward", "backward")}
    curve["gradients"] = [[p["grad"]["position"] + i, p["grad"]["rel_l2"], p["grad"]["envelope"]]
                          for i, p in enumerate(rep["params"])]  # one x per parameter, in trace order
    where = ", ".join(f"{d}: {fd[d]['name']} ({fd[d]['status']})" for d in ("forward", "backward") if fd[d]) \
        or "no traced site differs (only the optimizer step)"
    return [C.Check("bitwise.first_divergent_module", "bitwise", C.FAIL, "bitwise-equal traces",
                    {"pair": f"{first[0].label} ~ {other[0].label}", "classification": rep["classification"],
                     "forward": brief(fd["forward"]), "backward": brief(fd["backward"]),
                     "layers": rep["layers"], "curve": curve},
                    f"first divergent module by trace-diff, {where}", (other[0].label,))]
