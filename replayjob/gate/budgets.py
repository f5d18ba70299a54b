"""Performance budgets: declared bounds on arm/baseline ratios, decided from paired replays.

A budget file (TOML, pinned like the tolerances: its SHA-256 goes into ``[optimizer_batch]
budgets_sha256`` of every replay before the runs) holds, per arm, bounds on the ratio of a metric
to the baseline arm's::

    baseline = "ckpt-off"            # optional; must agree with reduce --baseline when both are given
    allow_cross_node = false         # optional; true admits pairs whose two replays ran on different
                                     # hosts or devices (declared before the runs, hence pinned)
    [ckpt-on]
    local_train_wall_s = { max_ratio = 1.35 }
    peak_memory_bytes = { max_ratio = 0.8 }

Metrics: :data:`TIME_METRICS` (decided on every device) and ``peak_memory_bytes`` (decided only when
every replay measured CUDA peak allocated memory, reset per replay; CPU max RSS only grows within a
process and cannot be reset, so there the bound is reported ``not_measurable`` and changes nothing).

**Design.** Replays are paired by the block of the schedule they recorded
(:mod:`replayjob.artifacts.schedule`): in block *b* the arm's value over the baseline's value is one
per-pair ratio.  What refuses the pairing is written once, in :data:`PAIRING_DOC` (docs/budgets.md shows
it), and found by :func:`schedule_problems` and :func:`_pairs`.  Two of its rules need a reason:

* *complete blocks*: leaving out a replay whose block lacks its pair would let a slow replay vanish from
  the decision, so such a block is refused, naming it, the arms it lacks and the replays it holds;
* *the design's positions*: the launch order is not recorded, but each block's order and its design give
  it back (the order a block's positions take depends on the design, the seed, the block and n only), so
  every block must give back the same one.

**Procedure.** The statistic is the geometric mean of the per-pair ratios, ``exp(mean(ln r_b))``;
its interval is the percentile bootstrap over pairs (seeded, :data:`~.stats.BOOTSTRAP_RESAMPLES`
resamples).  For repeated looks (``--until-decided``) the error is spent with Bonferroni alpha
spending over at most N looks: each look uses level ``alpha / N`` (interval confidence
``1 - 0.05 / N``), so by the union bound the chance that any look's interval misses the true
ratio, and hence that a decision is wrong, is at most 0.05 whichever look stops.  A bound
passes when the interval lies inside it, fails when it lies wholly outside, and is inconclusive
when it straddles it (fewer than 2 pairs are always inconclusive).

**Estimate.** For an inconclusive bound with n pairs, estimate e, limit L and h the half-width of
the interval on L's side (in log space: ``ln(high/e)`` when ``e < L``, else ``ln(e/low)``), the
width shrinks like ``1/sqrt(n)``, so about ``ceil(n * (h / |ln(L/e)|)^2) - n`` more paired blocks
(at least 1) would put L outside it.  When ``e == L`` no number of blocks decides it.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayjob.artifacts.budgets_file import HINT, KINDS, MEMORY_METRIC, METRICS, TIME_METRICS, BudgetsFile, shaped
from replayjob.artifacts.document import read_pinned_toml
from replayjob.artifacts.schedule import block_order
from replayjob.declaration import decode
from replayjob.errors import IntegrityError
from replayjob.gate import stats
from replayjob.gate.checks import FAIL, NOT_APPLICABLE, PASS, REFUSED, Arm, Check, agree
from replayjob.gate.evidence import Replay

INCONCLUSIVE = "inconclusive"
CONTENDED = "contended"  # a timing decision would rest on replays a contention probe flagged (exit 3)
CUDA_MEMORY = "cuda_max_allocated"
# The metrics (TIME_METRICS, MEMORY_METRIC) and bound kinds (KINDS) a budget file may name are its declaration's
# (replayjob.artifacts.budgets_file); re-exported here with the meaning of each.
__all__ = ["KINDS", "MEMORY_METRIC", "METRICS", "TIME_METRICS"]
# How the baseline's replays are paired with an arm's, and what refuses the pairing (check budgets.pairing).
PAIRING_DOC = ("Each ratio pairs the baseline's replay and the arm's in one block of the replays' schedule, and "
               "the pairing (check budgets.pairing) is refused, naming the blocks and replays, when: a replay has no "
               "schedule slot; the replays come from more than one schedule; a block holds an arm twice; a block "
               "lacks one of the schedule's arms (those whose replays carry its slot: a block runs every arm once, "
               "so a replay whose block has no baseline replay, or the reverse, is never silently left out; "
               "replay the missing arm in that block, or take its replays out of the reduced evidence); a block's "
               "positions are not 0 .. n-1 for its n arms, each once; a block's "
               "order contradicts the design (abba or random with its seed): every block's order must follow from "
               "one order of the arms, the launch order; or (unless allow_cross_node) a pair ran on different "
               "hosts or devices.")
# The meaning of each top-level key, metric and bound kind of a budget file (docs/budgets.md is rendered from them).
KEY_DOCS: dict[str, str] = {
    "baseline": "Optional: the arm (a string) every ratio's denominator is measured on; when reduce --baseline "
                "names one too, the two must agree. " + PAIRING_DOC,
    "allow_cross_node": "Optional, true or false (default false): true admits pairs whose two replays ran on "
                        "different hosts or devices; declared before the runs, hence pinned.",
}
METRIC_DOCS: dict[str, str] = {
    "local_train_wall_s": "The replay's measured seconds of its one optimizer update (micro-batch assembly, "
                          "forward, backward, gradient clipping, optimizer step; device-synchronised on CUDA).",
    "forward_wall_s": "The replay's measured seconds of the update's forward passes.",
    "backward_wall_s": "The replay's measured seconds of the update's backward passes.",
    "optimizer_wall_s": "The replay's measured seconds of the update's optimizer step.",
    "in_process_train_wall_s": "The median of the replay's measured in-process updates' seconds; needs "
                               "optimizer_batch.measured_updates >= 1 in every replay.",
    MEMORY_METRIC: "The replay's peak memory in bytes: decided only when every paired replay measured CUDA peak "
                   "allocated memory (reset per replay); otherwise (CPU max RSS, which only grows within a "
                   "process) the bound is reported not_measurable and changes nothing.",
}
KIND_DOCS: dict[str, str] = {
    "max_ratio": "Upper bound X on the ratio arm / baseline: pass when the interval's high <= X, fail when its "
                 "low > X, else inconclusive.",
    "min_ratio": "Lower bound Y on the ratio arm / baseline: pass when the interval's low >= Y, fail when its "
                 "high < Y, else inconclusive.",
}
ALPHA = 0.05
PROCEDURE = "bonferroni-alpha-spending"
ESTIMATE_FORMULA = "more = max(1, ceil(n * (h / |ln(limit / estimate)|)^2) - n)"


@dataclass(frozen=True)
class Bound:
    arm: str
    metric: str
    kind: str  # max_ratio | min_ratio
    limit: float

    @property
    def name(self) -> str:
        return f"budgets.{self.arm}.{self.metric}.{self.kind}"


@dataclass(frozen=True)
class Budgets:
    path: Path
    sha256: str
    baseline: str | None
    allow_cross_node: bool
    bounds: tuple[Bound, ...]


def cuda_memory(replays: list[Replay]) -> bool:
    """Did every replay measure CUDA's allocator peak (reset per replay)?  Only then is peak memory evidence
    about an arm; a CPU replay's max RSS only grows and counts the interpreter (provenance)."""
    return all(r.memory_kind == CUDA_MEMORY for r in replays)


def read_budgets(path: str | Path) -> Budgets:
    """Read a budget file through its declaration (:class:`~replayjob.artifacts.budgets_file.BudgetsFile`);
    every problem is refused naming the file, the arm, the metric and the bound."""
    p = Path(path)
    doc, sha = read_pinned_toml(p, "budget")
    body = shaped(doc)
    try:
        d = decode(body, BudgetsFile, where=p, hint=HINT)
    except IntegrityError as exc:
        raise _located(exc, p, body.get("arms")) from None
    # in the file's order of arms and metrics (the verdict lists the bounds so), each metric's kinds as KINDS
    bounds = tuple(Bound(arm, metric, kind, limit) for arm, table in d.arms.items()
                   for metric in body["arms"][arm] for kind, limit in table.bounds(metric).limits())
    return Budgets(p, sha, d.baseline, d.cross_node, bounds)


_FIELD = re.compile(r"field `([^`]*)`: (.*)", re.S)
_UNKNOWN = re.compile(r"object contains unknown field `(.*)`")


def _located(exc: IntegrityError, p: Path, arms: Any) -> IntegrityError:
    """A refusal of the declaration, located as the file reads: ``FILE: ARM.METRIC[.KIND]`` (the arms are
    gathered under ``arms`` only to be declared), its rule in the file's words."""
    m = _FIELD.fullmatch(exc.message)
    path, rule = (m.group(1), m.group(2)) if m else ("", exc.message)
    parts: list[str] = [path] if path else []
    in_arm = path.startswith("arms.") and isinstance(arms, dict)
    if in_arm:
        arm = max((k for k in arms if path == f"arms.{k}" or path.startswith(f"arms.{k}.")), key=len, default=None)
        if arm is None:
            in_arm = False
        else:
            rest = path[len("arms.") + len(arm):].lstrip(".")
            parts = [arm, *rest.split(".")] if rest else [arm]
    got = rule[rule.index(", got "):] if ", got " in rule else ""
    hint = exc.hint
    unknown = _UNKNOWN.fullmatch(rule)
    if unknown and not parts:
        rule = (f"unknown top-level key {unknown.group(1)!r}: the top level holds baseline, allow_cross_node and "
                "one table per arm")
    elif unknown and in_arm and len(parts) == 1:
        rule, hint = f"unknown metric {unknown.group(1)!r}", "metrics: " + ", ".join(METRICS)
    elif unknown and in_arm and len(parts) == 2:
        rule = f"unknown bound {unknown.group(1)!r}: must be an inline table with max_ratio and/or min_ratio"
    elif in_arm and len(parts) == 2 and rule.startswith("expected `object"):
        rule = "must be an inline table with max_ratio and/or min_ratio" + got
    elif in_arm and len(parts) == 3 and rule.startswith("expected `float"):
        rule = f"{parts[2]} must be a positive finite number" + (got or f" ({rule})")
    elif parts == ["baseline"]:
        rule = "baseline must be an arm name (a non-empty string)" + got
    elif parts == ["allow_cross_node"]:
        rule = "allow_cross_node must be true or false" + got
    elif in_arm and len(parts) == 1 and rule.startswith("expected `object"):
        rule = "must be a table of metric = { max_ratio = X } entries" + got
    return IntegrityError(rule, where=f"{p}: {'.'.join(parts)}" if parts else p, hint=hint)


def pin_check(replays: list[Replay], budgets: Budgets) -> Check:
    """The budget file's SHA-256 was pinned in every replay's config before the runs."""
    return agree("inputs.budgets_pinned", "inputs", [(r.label, r.budgets_sha256) for r in replays],
                 budgets.sha256, what="optimizer_batch.budgets_sha256 of every replay", status_on_fail=REFUSED)


def unread_pin_check(replays: list[Replay]) -> Check:
    """Replays that pinned a budget file, reduced without one: refused, since the bounds declared before the runs
    decide and a verdict without them would pass what they fail."""
    pinned = sorted({r.budgets_sha256 for r in replays if r.budgets_sha256})
    return Check("inputs.budgets_pinned", "inputs", REFUSED, "no budget file pinned (reduce was given none)",
                 {"pinned": pinned}, "the replays pinned a budget file (optimizer_batch.budgets_sha256) before the "
                 "runs: its bounds decide, so reduce them with --budgets FILE",
                 tuple(r.label for r in replays if r.budgets_sha256))


def metric_value(r: Replay, metric: str) -> float:
    """A replay's value of a budget metric: a timing, or the median of its measured in-process updates."""
    if metric == "in_process_train_wall_s":
        assert r.in_process_wall_s is not None
        return stats.median(r.in_process_wall_s)
    return r.measures[metric]


def schedule_problems(arms: dict[str, Arm]) -> list[str]:
    """What in the replays' blocks contradicts their schedule's design (:data:`PAIRING_DOC`): a block
    that holds an arm twice or lacks one of the schedule's arms, positions other than 0 .. n-1, or an order
    the design does not give that block.  Replays without a slot, and more than one schedule, are refused
    elsewhere; the positions are checked only for one schedule."""
    slotted = [(name, r) for name, a in arms.items() for r in a.replays if r.slot is not None]
    names = sorted({name for name, _ in slotted})
    blocks: dict[int, list[tuple[str, Replay]]] = defaultdict(list)
    for name, r in slotted:
        assert r.slot is not None
        blocks[r.slot.block].append((name, r))
    problems: list[str] = []
    whole: dict[int, list[tuple[str, Replay]]] = {}
    incomplete: dict[tuple[str, ...], list[int]] = defaultdict(list)  # the arms lacked -> the blocks lacking them
    for b, held in sorted(blocks.items()):
        counts = {a: sum(1 for m, _ in held if m == a) for a in names}
        twice = [a for a in names if counts[a] > 1]
        lacks = tuple(a for a in names if counts[a] == 0)
        for a in twice:
            problems += [f"{r.label}: block {b} holds arm {a} twice" for m, r in held if m == a]
        if lacks:
            incomplete[lacks].append(b)
        if not twice and not lacks:
            whole[b] = held
    for lacks, bs in incomplete.items():
        held = [x for b in bs for x in sorted(blocks[b], key=lambda x: x[1].label)]
        which, (lack, hold, there) = ", ".join(map(str, bs)), (("lack", "hold", "those blocks") if len(bs) > 1
                                                               else ("lacks", "holds", "that block"))
        problems.append(f"block{'s' if len(bs) > 1 else ''} {which} {lack} arm(s) {', '.join(lacks)} but {hold} "
                        f"{_labels(held)}: a block runs every arm once, so these replays have no pair (replay the "
                        f"missing arm(s) in {there}, or take these replays out of the reduced evidence)")
    schedules = {(r.slot.design, r.slot.seed) for _, r in slotted if r.slot is not None}
    if len(schedules) != 1:
        return problems
    ((design, seed),) = schedules
    n = len(names)
    launch: dict[int, tuple[str, ...]] = {}  # block -> the launch order its order and the design give back
    for b, held in whole.items():
        at = {r.slot.position: m for m, r in held if r.slot is not None}
        if sorted(at) != list(range(n)):
            problems.append(f"block {b}: positions {_positions(held)}; the design gives its {n} arm(s) positions "
                            f"0 .. {n - 1}, each once")
            continue
        perm = block_order([str(i) for i in range(n)], design, seed, b)  # position -> index in the launch order
        order = [""] * n
        for pos, i in enumerate(perm):
            order[int(i)] = at[pos]
        launch[b] = tuple(order)
    if len(set(launch.values())) > 1:
        agreeing: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for b, order_b in sorted(launch.items()):
            agreeing[order_b].append(b)
        ref = max(agreeing, key=lambda o: (len(agreeing[o]), -agreeing[o][0]))
        for b, order_b in sorted(launch.items()):
            if order_b != ref:
                expected = block_order(list(ref), design, seed, b)
                problems.append(f"block {b}: positions {_positions(whole[b])}, but {design} with seed {seed} "
                                f"runs block {b} as {', '.join(expected)} (the order of block(s) "
                                f"{', '.join(map(str, agreeing[ref]))})")
    return problems


def _labels(held: list[tuple[str, Replay]]) -> str:
    return ", ".join(r.label for _, r in held)


def _positions(held: list[tuple[str, Replay]]) -> str:
    at = sorted((-1 if r.slot is None else r.slot.position, r.label) for _, r in held)
    return ", ".join(f"{label} at {pos}" for pos, label in at)


def _pairs(arm: Arm, base: Arm, allow_cross_node: bool) -> tuple[list[tuple[Replay, Replay]], list[str]]:
    """(baseline, arm) replays per shared block, and what refuses the pairing."""
    problems: list[str] = []
    by_block: dict[str, dict[int, Replay]] = {}
    for a in (base, arm):
        blocks: dict[int, Replay] = {}
        for r in a.replays:
            if r.slot is None:
                problems.append(f"{r.label}: no schedule slot (run the arms interleaved: replay --slot)")
            elif r.slot.block in blocks:
                problems.append(f"{r.label}: block {r.slot.block} holds arm {a.name} twice")
            else:
                blocks[r.slot.block] = r
        by_block[a.name] = blocks
    pairs = [(by_block[base.name][b], by_block[arm.name][b])
             for b in sorted(set(by_block[base.name]) & set(by_block[arm.name]))]
    if not allow_cross_node:
        for rb, ra in pairs:
            if not rb.placement or rb.placement != ra.placement:
                problems.append(f"{rb.label} ~ {ra.label}: block ran on {rb.placement or '?'} "
                                f"and {ra.placement or '?'} (declare allow_cross_node = true to admit)")
    return pairs, problems


def _interval(logs: list[float], confidence: float) -> tuple[float, float, float]:
    """Geometric mean ratio and its percentile-bootstrap interval over pairs (an infinity where it overflows)."""
    import numpy as np

    arr = np.asarray(logs, dtype=np.float64)
    rng = np.random.RandomState(stats.BOOTSTRAP_SEED)
    means = arr[rng.randint(0, len(logs), size=(stats.BOOTSTRAP_RESAMPLES, len(logs)))].mean(axis=1)
    tail = (1.0 - confidence) / 2.0
    lo, hi = (float(x) for x in np.quantile(means, [tail, 1.0 - tail]))
    return _exp(float(arr.mean())), _exp(lo), _exp(hi)


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _paired_ratio(vals: list[tuple[float, float]], confidence: float) -> tuple[float, float, float] | str:
    """:func:`_interval` of the per-pair ratios (arm / baseline) of ``vals`` (baseline, arm), or why there is none: a
    value zero, negative or not finite, or a ratio or interval bound that leaves the positive finite numbers (two
    finite values can still overflow or underflow: 1e300 / 1e-300)."""
    if any(not math.isfinite(x) or x <= 0.0 for v in vals for x in v):  # a NaN is never within a bound
        return "a paired value is zero, negative or not finite: no ratio"
    ratios = [a / b for b, a in vals]
    if not all(math.isfinite(x) and x > 0.0 for x in ratios):
        return "a per-pair ratio leaves the positive finite numbers (overflow or underflow): no ratio"
    est, low, high = _interval([math.log(x) for x in ratios], confidence)
    if not all(math.isfinite(x) and x > 0.0 for x in (est, low, high)):
        return "the ratio or its interval leaves the positive finite numbers (overflow or underflow): no decision"
    return est, low, high


def more_blocks(n: int, estimate: float, low: float, high: float, limit: float) -> int | None:
    """Paired blocks to add so the interval clears ``limit`` (:data:`ESTIMATE_FORMULA`)."""
    if n < 2:
        return 2 - n
    d = abs(math.log(limit / estimate))
    if d == 0.0:
        return None
    h = math.log(high / estimate) if estimate < limit else math.log(estimate / low)
    return max(1, math.ceil(n * (h / d) ** 2) - n)


def _decide(bound: Bound, pairs: list[tuple[Replay, Replay]], confidence: float) -> dict[str, Any]:
    out: dict[str, Any] = {"arm": bound.arm, "metric": bound.metric, "kind": bound.kind, "limit": bound.limit,
                           "pairs": len(pairs), "ratio": None, "low": None, "high": None, "more_blocks": None}
    vals = [(metric_value(b, bound.metric), metric_value(a, bound.metric)) for b, a in pairs]
    if any(not math.isfinite(x) or x <= 0.0 for v in vals for x in v):  # a NaN is never within a bound
        return {**out, "decision": REFUSED, "note": "a paired value is zero, negative or not finite: no ratio"}
    if len(pairs) < 2:
        return {**out, "decision": INCONCLUSIVE, "more_blocks": 2 - len(pairs),
                "note": "fewer than 2 pairs cannot give an interval"}
    found = _paired_ratio(vals, confidence)
    if isinstance(found, str):
        return {**out, "decision": REFUSED, "note": found}
    est, low, high = found
    out.update(ratio=est, low=low, high=high)
    inside = high <= bound.limit if bound.kind == "max_ratio" else low >= bound.limit
    outside = low > bound.limit if bound.kind == "max_ratio" else high < bound.limit
    if inside or outside:
        return {**out, "decision": PASS if inside else FAIL, "note": ""}
    more = more_blocks(len(pairs), est, low, high, bound.limit)
    note = ("the estimate equals the limit: no number of blocks decides it" if more is None
            else f"about {more} more paired block(s) would decide it")
    return {**out, "decision": INCONCLUSIVE, "more_blocks": more, "note": note}


def evaluate(budgets: Budgets, arms: dict[str, Arm], baseline: str | None, max_looks: int,
             admitted: bool, contended: Sequence[str] = ()) -> tuple[dict[str, Any], list[Check]]:
    """Decide every bound: the verdict's ``budgets`` section and one check per bound.  ``contended`` names
    the replays whose timing is not admitted (:mod:`replayjob.runtime.contention_probe`): a time bound is then
    ``not_evaluated`` (memory bounds are still decided)."""
    confidence = 1.0 - ALPHA / max_looks
    slots = sorted({(r.slot.design, r.slot.seed) for a in arms.values() for r in a.replays if r.slot})
    section: dict[str, Any] = {
        "file": None, "baseline": baseline, "allow_cross_node": budgets.allow_cross_node,
        "design": {"pairing": "per schedule block", "schedules": [{"design": d, "seed": s} for d, s in slots]},
        "procedure": {"name": PROCEDURE, "alpha": ALPHA, "max_looks": max_looks, "look_confidence": confidence,
                      "statistic": "geometric mean of per-pair ratios (arm / baseline)",
                      "interval": "percentile bootstrap over pairs", "seed": stats.BOOTSTRAP_SEED,
                      "resamples": stats.BOOTSTRAP_RESAMPLES, "estimate": ESTIMATE_FORMULA},
        "bounds": [],
    }
    checks: list[Check] = []
    problems: list[str] = []
    if len(slots) > 1:
        problems.append("replays come from more than one schedule: " + ", ".join(f"{d}:{s}" for d, s in slots))
    pairs: dict[str, list[tuple[Replay, Replay]]] = {}
    missing = sorted({b.arm for b in budgets.bounds if b.arm not in arms or b.arm == baseline})
    if baseline is None or baseline not in arms or missing:
        problems.append(f"budgets need a baseline arm with replays (got {baseline!r}) and bounds on other arms "
                        f"with replays (not: {', '.join(missing) or '-'})")
    else:
        for name in sorted({b.arm for b in budgets.bounds}):
            pairs[name], found = _pairs(arms[name], arms[baseline], budgets.allow_cross_node)
            problems += found
        problems = list(dict.fromkeys([*problems, *schedule_problems(arms)]))  # an arm twice is found by both
    if any(b.metric == "in_process_train_wall_s" for b in budgets.bounds) and any(
            r.in_process_wall_s is None for a in arms.values() for r in a.replays):
        problems.append("an in_process_train_wall_s bound needs optimizer_batch.measured_updates >= 1 in every replay")
    checks.append(Check("budgets.pairing", "budgets", REFUSED if problems else PASS,
                        "one schedule; every block holds each of its arms once, at the positions its design "
                        "assigns; pairs on one host and device", None,
                        "paired, interleaved design the bounds are decided on", tuple(problems)))
    decisions: dict[str, list[str]] = defaultdict(list)
    for bound in budgets.bounds:
        row: dict[str, Any]
        if problems or not admitted or (contended and bound.metric in TIME_METRICS):
            why = ("pairing refused" if problems else "timing not admitted: the exact-input gate did not pass"
                   if not admitted else f"timing not admitted: contended replay(s) {', '.join(contended)}")
            row = {"arm": bound.arm, "metric": bound.metric, "kind": bound.kind, "limit": bound.limit,
                   "decision": "not_evaluated", "note": why}
            status = NOT_APPLICABLE
        elif bound.metric == MEMORY_METRIC and not cuda_memory([r for pair in pairs[bound.arm] for r in pair]):
            row = {"arm": bound.arm, "metric": bound.metric, "kind": bound.kind, "limit": bound.limit,
                   "decision": "not_measurable",
                   "note": "peak memory is decided only on CUDA (peak allocated, reset per replay); CPU max "
                           "RSS only grows within a process"}
            status = NOT_APPLICABLE
        else:
            row = _decide(bound, pairs[bound.arm], confidence)
            status = row["decision"]
        section["bounds"].append(row)
        decisions[row["decision"]].append(bound.name)
        observed = {k: row.get(k) for k in ("ratio", "low", "high", "pairs", "more_blocks")}
        checks.append(Check(bound.name, "budgets", status, {bound.kind: bound.limit}, observed,
                            f"{row['decision']}: {row['note']}" if row["note"] else row["decision"]))
    section["decisions"] = dict(sorted(decisions.items()))
    return section, checks


def paired_comparisons(arms: dict[str, Arm], baseline: str | None, metric: str, max_looks: int,
                       admitted: bool) -> dict[str, Any] | None:
    """Each arm's paired comparison with the baseline on ``metric`` at the per-look level of the alpha
    spending (confidence ``1 - ALPHA / max_looks``, as the budgets): the geometric mean of the per-block
    ratios and its bootstrap interval; ``decided`` when the interval excludes 1.  None unless every replay
    has a schedule slot (an unpaired run has no blocks to add)."""
    replays = [r for a in arms.values() for r in a.replays]
    if baseline is None or baseline not in arms or not replays or any(r.slot is None for r in replays):
        return None
    confidence = 1.0 - ALPHA / max_looks
    out: dict[str, Any] = {"metric": metric, "max_looks": max_looks, "look_confidence": confidence,
                           "statistic": "geometric mean of per-pair ratios (arm / baseline)",
                           "interval": "percentile bootstrap over pairs", "arms": {}}
    design = schedule_problems(arms)
    for name in sorted(a for a in arms if a != baseline):
        pairs, problems = _pairs(arms[name], arms[baseline], allow_cross_node=True)
        problems = list(dict.fromkeys([*problems, *design]))
        row: dict[str, Any] = {"pairs": len(pairs), "ratio": None, "low": None, "high": None, "excludes_1": None}
        vals = [(metric_value(b, metric), metric_value(a, metric)) for b, a in pairs] if not problems else []
        if problems:
            row.update(decision="not_evaluated", note="; ".join(problems))
        elif not admitted:
            row.update(decision="not_evaluated", note="timing not admitted")
        elif any(not math.isfinite(x) or x <= 0.0 for v in vals for x in v):
            row.update(decision="not_evaluated", note="a paired value is zero, negative or not finite")
        elif len(pairs) < 2:
            row.update(decision="undecided", note="fewer than 2 pairs cannot give an interval")
        elif isinstance(found := _paired_ratio(vals, confidence), str):
            row.update(decision="not_evaluated", note=found)
        else:
            est, low, high = found
            excludes = low > 1.0 or high < 1.0
            row.update(ratio=est, low=low, high=high, excludes_1=excludes,
                       decision="decided" if excludes else "undecided",
                       note="" if excludes else "the interval includes 1: more paired blocks may decide it")
        out["arms"][name] = row
    return out
