"""Attribution: which difference between the source and the trainer explains the gap.

Each test swaps one factor of the trainer's computation for the source's and asks how much of the
gap that closes, measured on the mean |log-ratio| over the tokens both sides recorded::

    explained = 1 - mean|source - hypothesis| / mean|source - trainer|

A test **closes** the gap when it explains at least :data:`CLOSES` of it.  The tests, in the order
they are reported:

* ``temperature``: the recorded values equal the trainer's logits divided by a temperature the
  trainer did not apply (each source's own, or 1: none), or the reverse; the temperature that fits
  best on a grid is reported as evidence;
* ``truncation``: the recorded values are those of the trainer's distribution truncated to the
  sampler's top-k / top-p set and renormalised; sampled tokens outside that set are counted;
* ``precision``: recomputing with the forward in the sampler's dtype closes the gap;
* ``padding``: recomputing in the sampler's layout (left padding, or positions counted over it)
  closes the gap, or the gap follows the padding offset (rows the sampler did not pad carry none
  of it, and a row's gap grows with its offset: correlation at least 0.5);
* ``routing`` (a mixture-of-experts model): recomputing the trainer with the experts of the sampler-side
  pass forced closes the gap, i.e. the gap is the routing flips' (located by
  :mod:`~replayjob.mismatch.routing`, with the share of the log-ratio mass they reach);
* ``combined``: every recorded sampler setting at once, when no single one closes the gap.

The attribution is the test that closes the most; when none does (and not all together either) it
is ``unexplained: kernel or batch variance``, with its size.  Across a policy lag (the source's
weights predate step K) nothing is attributed unless the caller allows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from replayjob.mismatch import routing, stats
from replayjob.mismatch.views import Hypothesis, Source, Views, fitted_temperature

if TYPE_CHECKING:
    from torch import Tensor

CLOSES = 0.9  # share of the gap a test must explain to close it
TESTS = ("temperature", "truncation", "precision", "padding", "routing", "combined")
UNEXPLAINED = "unexplained: kernel or batch variance"


@dataclass
class TestResult:
    name: str
    applicable: bool
    reason: str = ""              # why not applicable
    label: str = ""               # the hypothesis that explained most
    explained: float | None = None
    residual_abs_mean: float | None = None
    residual_abs_max: float | None = None
    evidence: list[str] = field(default_factory=list)

    @property
    def closes(self) -> bool:
        return self.applicable and self.explained is not None and self.explained >= CLOSES

    def to_json(self) -> dict[str, Any]:
        return {"test": self.name, "applicable": self.applicable, "closes": self.closes,
                "explained": self.explained, "hypothesis": self.label or None,
                "residual_abs_mean": self.residual_abs_mean, "residual_abs_max": self.residual_abs_max,
                "reason": self.reason or None, "evidence": list(self.evidence)}


@dataclass
class Attribution:
    attribution: str
    tests: list[TestResult]
    size: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {"attribution": self.attribution, "size": self.size, "tests": [t.to_json() for t in self.tests]}


def _explain(recorded: Tensor, trainer: Tensor, hyp: Tensor) -> tuple[float, float, float, int]:
    """``(explained, residual mean, residual max, tokens outside)`` over finite hypothesis values."""
    import torch
    gap = (recorded - trainer).abs().mean()
    inside = torch.isfinite(hyp)
    outside = int((~inside).sum())
    if not bool(inside.any()):
        return -math.inf, math.inf, math.inf, outside
    res = (recorded[inside] - hyp[inside]).abs()
    mean, top = float(res.mean()), float(res.max())
    return (1.0 - mean / float(gap) if float(gap) > 0 else 1.0), mean, top, outside


def _best(hyps: list[Hypothesis], recorded: Tensor, trainer: Tensor, ok: Tensor) -> tuple[Hypothesis, float, float,
                                                                                              float, int] | None:
    best = None
    for h in hyps:
        e, mean, top, outside = _explain(recorded[ok], trainer[ok], h.values[ok])
        if best is None or e > best[1]:
            best = (h, e, mean, top, outside)
    return best


def _fill(res: TestResult, best: tuple[Hypothesis, float, float, float, int]) -> None:
    h, e, mean, top, _ = best
    res.label, res.explained = h.label, e if math.isfinite(e) else None
    res.residual_abs_mean = mean if math.isfinite(mean) else None
    res.residual_abs_max = top if math.isfinite(top) else None
    if res.explained is not None:
        res.evidence.insert(0, f"{h.label}: explains {100 * max(e, 0.0):.1f}% of the gap "
                               f"(residual mean |.| {mean:.3g}, max {top:.3g})")


def _tested(name: str, applicable: bool, reason: str, v: Views, src: Source, ok: Tensor,
            hyps: list[Hypothesis]) -> TestResult:
    """A test's result: not applicable with ``reason``, else its best-explaining hypothesis filled in."""
    res = TestResult(name, applicable)
    if not applicable:
        res.reason = reason
        return res
    best = _best(hyps, src.values, v.trainer, ok)
    assert best is not None  # applicable implies hypotheses
    _fill(res, best)
    return res


def attribute(v: Views, src: Source, allow_lag: bool) -> Attribution:
    """Run every test on one source (see the module docstring)."""
    import torch
    ok = torch.isfinite(src.values) & torch.isfinite(v.trainer)  # the finite tokens (non-finite: reported apart)
    lr = v.trainer[ok] - src.values[ok]
    size = {"abs_mean": float(lr.abs().mean()) if lr.numel() else 0.0,
            "abs_max": float(lr.abs().max()) if lr.numel() else 0.0}
    if src.lag and not allow_lag:
        return Attribution(f"not attributed: policy lag of {src.lag} step(s)", [
            TestResult(t, False, reason=f"not run across a policy lag of {src.lag} step(s); --allow-lag runs them")
            for t in TESTS], size)
    if not bool((lr != 0).any()):
        return Attribution("none: the source equals the trainer's recompute bitwise", [
            TestResult(t, False, reason="nothing to attribute") for t in TESTS], size)
    by_test: dict[str, list[Hypothesis]] = {}
    for h in v.hypotheses:
        by_test.setdefault(h.test, []).append(h)
    results = [_temperature(v, src, ok, by_test.get("temperature", [])),
               _truncation(v, src, ok, by_test.get("truncation", [])),
               _precision(v, src, ok, by_test.get("precision", [])),
               _padding(v, src, ok, lr, by_test.get("padding", [])),
               _routing(v, src, ok, lr, by_test.get("routing", [])),
               _combined(v, src, ok, by_test.get("combined", []))]
    single = sorted((r for r in results[:5] if r.closes), key=lambda r: -(r.explained or 0.0))
    if single:
        name = single[0].name
        rest = [r.name for r in single[1:]]
        return Attribution(name + (f" (also closed by {', '.join(rest)})" if rest else ""), results, size)
    if results[5].closes:
        parts = [r.name for r in sorted(results[:5], key=lambda r: -(r.explained or 0.0))
                 if r.applicable and (r.explained or 0.0) > 0.0]
        return Attribution("combined: " + (" + ".join(parts) or "the sampler's settings together"), results, size)
    lag = f"; across a policy lag of {src.lag} step(s), which the gap includes" if src.lag else ""
    return Attribution(f"{UNEXPLAINED} (mean |log-ratio| {size['abs_mean']:.3g}, max {size['abs_max']:.3g}{lag})",
                       results, size)


def _temperature(v: Views, src: Source, ok: Tensor, hyps: list[Hypothesis]) -> TestResult:
    res = _tested("temperature", bool(hyps), "the trainer's temperature is the only one recorded, and it is 1",
                  v, src, ok, hyps)
    if not res.applicable:
        return res
    residual = v.grid_residual.get(src.name)
    if residual is not None and v.grid:
        fit = fitted_temperature(residual)
        res.evidence.append(f"best-fitting temperature (least squares over [0.25, 4]): {fit:.3f} (the trainer "
                            f"applies {v.trainer_side.temperature:g}, the source's settings say "
                            f"{src.side.temperature:g})")
    return res


def _truncation(v: Views, src: Source, ok: Tensor, hyps: list[Hypothesis]) -> TestResult:
    res = _tested("truncation", bool(hyps) and src.side.truncates,
                  "the source's settings truncate nothing: top_k = 0, top_p = 1" if hyps or not src.side.truncates
                  else "no truncation recomputed", v, src, ok, hyps)
    if res.applicable and v.outside_set is not None:
        out = int(v.outside_set[ok].sum())
        res.evidence.append(f"{out} of {int(ok.sum())} sampled tokens lie outside the trainer's top_k="
                            f"{src.side.top_k}, top_p={src.side.top_p:g} set")
        if out and res.explained is not None and out > 0.01 * int(ok.sum()):
            res.explained = min(res.explained, 1.0 - out / int(ok.sum()))  # the sets disagree for those tokens
    return res


def _precision(v: Views, src: Source, ok: Tensor, hyps: list[Hypothesis]) -> TestResult:
    return _tested("precision", bool(hyps) and src.side.dtype != v.trainer_side.dtype,
                   "the source's forward ran in the trainer's dtype" if src.side.recorded
                   else "the source's dtype is not recorded", v, src, ok, hyps)


def _padding(v: Views, src: Source, ok: Tensor, lr: Tensor, hyps: list[Hypothesis]) -> TestResult:
    res = _tested("padding", bool(hyps) and src.side.layout != v.trainer_side.layout,
                  "the source used the trainer's layout" if hyps else "no other layout recomputed", v, src, ok, hyps)
    if not res.applicable:
        return res
    offsets = stats.by_pad_offset(lr, v.row[ok], v.pad_offset[ok])
    groups = ", ".join(f"{g['offset']}: {g['abs_mean']:.3g}" for g in offsets["groups"][:8])
    corr = offsets["correlation"]
    res.evidence.append(f"mean |log-ratio| by left-padding offset {{{groups}}}"
                        + (f"; correlation of a row's offset with its mean |log-ratio| {corr:.2f}"
                           if corr is not None else ""))
    follows = _follows_offset(lr, v.pad_offset[ok], corr)
    if follows is not None and follows > (res.explained if res.explained is not None else -math.inf):
        res.explained = follows
        res.label = "the gap follows the left-padding offset"
        res.evidence.append(f"the gap follows the padding: rows without left padding carry "
                            f"{100 * (1 - follows):.1f}% of the padded rows' mean |log-ratio|")
    return res


def _follows_offset(lr: Tensor, pad: Tensor, corr: float | None) -> float | None:
    """``1 - mean|lr| of unpadded tokens / mean|lr| of padded ones`` when both kinds of rows are there and a
    row's gap grows with its offset (correlation >= 0.5); None otherwise."""
    unpadded, padded = pad == 0, pad > 0
    if corr is None or corr < 0.5 or not bool(unpadded.any()) or not bool(padded.any()):
        return None
    inside = float(lr[padded].abs().mean())
    return 1.0 - float(lr[unpadded].abs().mean()) / inside if inside > 0 else None


def _routing(v: Views, src: Source, ok: Tensor, lr: Tensor, hyps: list[Hypothesis]) -> TestResult:
    if not v.routing:
        reason = "the recompute recorded no routing (a dense model, or a recompute that does not observe it)"
    elif routing.SAMPLER_SIDE not in v.routing:
        reason = "the sampler-side pass was not run"
    else:
        reason = "the sampler-side pass sends every token to the trainer pass's experts: no routing flip"
    res = _tested("routing", bool(hyps), reason, v, src, ok, hyps)
    reached = routing.reach(v, ok, lr) if res.applicable else None
    if reached is not None:
        res.evidence.extend(routing.evidence(reached))
    return res


def _combined(v: Views, src: Source, ok: Tensor, hyps: list[Hypothesis]) -> TestResult:
    return _tested("combined", bool(hyps) and src.side == v.sampler_side,
                   "only for the sampler's own source" if hyps else "not recomputed", v, src, ok, hyps)
