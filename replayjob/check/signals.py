"""``signals``: grade a run's per-step diagnostics against behavioural rules (KILL / WARN / OK).

The diagnostics are streamed once; each rule keeps only the trailing window of the numbers it
needs.  Reducers (``x`` is the row's ``step``, or its position when rows have none):

* ``last``, ``mean``, ``min``, ``max`` of the leaf over the window;
* ``cv``: population standard deviation over ``|mean|`` (0 when both are 0, infinite when only
  the mean is);
* ``slope``: least-squares slope of the leaf against ``x`` (per step);
* ``pearson``: correlation of the leaf with the per-row change of ``delta_of``: a row ``t`` that
  carries the leaf and ``delta_of`` forms a pair with ``delta_of(t) - delta_of(t-1)`` only when the
  row immediately before it carries ``delta_of`` too, so a change never spans a row where a leaf
  is missing (such a row breaks the chain; the next pair starts after it).

A ``null`` leaf is treated as absent in that row; a string or bool is refused, and so is an integer
leaf or ``step`` too large for a float.  A non-finite input in the window (a NaN or infinite step
for ``slope``, a per-row change of ``delta_of`` beyond the float range for ``pearson``) or an
undefined statistic (a correlation with zero variance) grades as the rule's ``on_nonfinite``
status; statistics are computed on values scaled by a power of two, so large finite values never
overflow a sum or a square.  A consistency rule grades a non-finite value or relative gap as beyond
its bounds: KILL when it has ``kill_above``, else WARN.  Too few values for any rule refuses the
whole verdict (exit 2) naming each such rule, rather than grading on no evidence.
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replayjob.check.leaves import MISSING, get_leaf, parse_path
from replayjob.check.rows import Steps, iter_rows
from replayjob.check.rows import as_float as _float
from replayjob.check.rules import ConsistencyRule, Rules, SignalRule
from replayjob.errors import IntegrityError, RefusedError
from replayjob.fsio import check_no_symlinks
from replayjob.jsonio import read_json_object

SCHEMA = "replayjob.signals_verdict/1"
DIAG_FILE = "diag.jsonl"


@dataclass
class SignalResult:
    name: str
    kind: str  # "signal" | "consistency"
    status: str  # "OK" | "WARN" | "KILL" | "SKIP"
    value: float | None
    explanation: str
    meaning: str

    def to_json(self) -> dict[str, Any]:
        v = self.value
        return {"name": self.name, "kind": self.kind, "status": self.status,
                "value": v if v is None or math.isfinite(v) else repr(v), "explanation": self.explanation,
                "meaning": self.meaning}


@dataclass
class SignalsReport:
    source: str
    rules: str
    rows: int
    results: list[SignalResult] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        statuses = {r.status for r in self.results}
        return "KILL" if "KILL" in statuses else "WARN" if "WARN" in statuses else "OK"

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict == "KILL" else 0

    def names(self, status: str) -> list[str]:
        return [r.name for r in self.results if r.status == status]

    def quiet(self) -> str:
        kills, warns = self.names("KILL"), self.names("WARN")
        parts = [f"signals {self.verdict}"]
        if kills:
            parts.append("kill: " + ", ".join(kills))
        if warns:
            parts.append("warn: " + ", ".join(warns))
        return "; ".join(parts)

    def render(self) -> str:
        width = max([len("SIGNAL")] + [len(r.name) for r in self.results])
        lines = [f"signals {self.verdict}: {self.source} ({self.rows} rows; rules {self.rules})",
                 f"{'STATUS':<6}  {'SIGNAL':<{width}}  EXPLANATION"]
        lines += [f"{r.status:<6}  {r.name:<{width}}  {r.explanation}" for r in self.results]
        lines.append(self.quiet())
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "verdict": self.verdict, "source": self.source, "rules": self.rules,
                "rows": self.rows, "signals": [r.to_json() for r in self.results]}


def resolve_source(source: str | Path) -> tuple[Path, Path]:
    """``(diag.jsonl, directory holding summaries)`` for a run directory or a diag file (a diag.jsonl found
    in a run directory may not be a symbolic link; one named directly may)."""
    p = Path(source)
    if p.is_dir():
        return check_no_symlinks(p, p / DIAG_FILE, what="diag file"), p
    return p, p.parent


def _number(v: Any, lineno: int, leaf: str, rule: str, where: Path) -> float | None:
    if v is MISSING or v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise IntegrityError(f"line {lineno}: leaf {leaf} is {type(v).__name__} {v!r:.40}; signal {rule!r} "
                             "needs a number", where=where)
    return _float(v, f"line {lineno}: leaf {leaf}", where)


class _Collector:
    """The trailing window of values one signal rule needs, filled row by row.

    Each entry is ``(x, value, other)``: ``other`` is 0 for most reducers and, for ``pearson``,
    the change of ``delta_of`` from the immediately preceding row (so the window counts pairs).
    """

    def __init__(self, rule: SignalRule):
        self.rule = rule
        self.steps = parse_path(rule.leaf)
        self.delta_steps = parse_path(rule.delta_of) if rule.delta_of else None
        self.values: deque[tuple[float, float, float]] = deque(maxlen=rule.window or None)
        self.previous: float | None = None  # delta_of in the row just before this one (pearson)

    def add(self, x: float, row: dict[str, Any], lineno: int, where: Path) -> None:
        v = _number(get_leaf(row, self.steps), lineno, self.rule.leaf, self.rule.name, where)
        if self.delta_steps is None:
            if v is not None:
                self.values.append((x, v, 0.0))
            return
        w = _number(get_leaf(row, self.delta_steps), lineno, self.rule.delta_of or "", self.rule.name, where)
        previous, self.previous = self.previous, w
        if v is not None and w is not None and previous is not None:
            self.values.append((x, v, w - previous))

    def count(self) -> int:
        return len(self.values)


def _scaled(vs: list[float]) -> tuple[list[float], int]:
    """``vs`` times ``2**-e``, with ``e`` the binary exponent of the largest ``|v|`` (so every scaled value
    is below 1 in magnitude), and ``e``.

    Scaling by a power of two is exact in the normal range, so a statistic computed on the scaled
    values and scaled back is the one computed directly, bit for bit, but sums and squares of values
    near the float range's ends cannot overflow (``1.7e308`` on every row, deviations of ``1e200``).
    """
    e = math.frexp(max(abs(v) for v in vs))[1]
    return [math.ldexp(v, -e) for v in vs], e


def _unscale(v: float, e: int) -> float:
    """``v * 2**e``, infinite (with ``v``'s sign) where that is beyond the float range."""
    try:
        return math.ldexp(v, e)
    except OverflowError:
        return math.copysign(math.inf, v)


def _mean(v: list[float]) -> float:
    s, e = _scaled(v)
    return _unscale(math.fsum(s) / len(s), e)


def _pearson(xs: list[float], ys: list[float]) -> float:
    xs, ys = _scaled(xs)[0], _scaled(ys)[0]  # a correlation does not change when either side is scaled
    mx, my = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    sxy = math.fsum((a - mx) * (b - my) for a, b in zip(xs, ys, strict=True))
    sxx = math.fsum((a - mx) ** 2 for a in xs)
    syy = math.fsum((b - my) ** 2 for b in ys)
    denominator = math.sqrt(sxx) * math.sqrt(syy)
    return sxy / denominator if denominator > 0 else math.nan


def _cv(vs: list[float]) -> float:
    s = _scaled(vs)[0]  # the ratio does not change when every value is scaled
    m = math.fsum(s) / len(s)
    sd = math.sqrt(math.fsum((v - m) ** 2 for v in s) / len(s))
    return (0.0 if sd == 0 else math.inf) if m == 0 else sd / abs(m)


def _slope(xs: list[float], vs: list[float]) -> float:
    if not all(math.isfinite(x) for x in xs):  # a NaN or infinite step
        return math.nan
    (xs, ex), (vs, ev) = _scaled(xs), _scaled(vs)
    mx, mv = math.fsum(xs) / len(xs), math.fsum(vs) / len(vs)
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    if not sxx > 0:
        return math.nan
    return _unscale(math.fsum((x - mx) * (v - mv) for x, v in zip(xs, vs, strict=True)) / sxx, ev - ex)


def reduce_values(reducer: str, data: list[tuple[float, float, float]]) -> float:
    """Apply ``reducer`` to ``(x, value, other)`` triples (``other``: the pearson partner, already a
    per-row change); non-finite inputs give a non-finite result, and so does a statistic beyond the
    float range (never an exception)."""
    xs = [d[0] for d in data]
    vs = [d[1] for d in data]
    if reducer == "last":
        return vs[-1]
    if reducer == "pearson":  # data: (x, value, change of delta_of since the previous row)
        deltas = [d[2] for d in data]
        bad = [v for v in (*vs, *deltas) if not math.isfinite(v)]
        return bad[0] if bad else _pearson(vs, deltas)
    bad = [v for v in vs if not math.isfinite(v)]
    if bad:
        return next((v for v in bad if math.isnan(v)), bad[0])
    if reducer == "mean":
        return _mean(vs)
    if reducer == "min":
        return min(vs)
    if reducer == "max":
        return max(vs)
    if reducer == "cv":
        return _cv(vs)
    if reducer == "slope":
        return _slope(xs, vs)
    raise ValueError(f"unknown reducer {reducer!r}")


def _grade_signal(c: _Collector) -> SignalResult:
    rule, data = c.rule, list(c.values)
    value = reduce_values(rule.reducer, data)
    over = f"{rule.reducer}({rule.leaf}" + (f", delta {rule.delta_of}" if rule.delta_of else "") + ")"
    what = f"{over} over {c.count()} {'pairs' if rule.reducer == 'pearson' else 'rows'}"
    if not math.isfinite(value):
        return SignalResult(rule.name, "signal", rule.on_nonfinite, value,
                            f"{what} = {value!r}: non-finite or undefined", rule.meaning)
    status, reason = rule.thresholds.grade(value)
    return SignalResult(rule.name, "signal", status, value, f"{what} = {value:.6g} {reason}", rule.meaning)


def _grade_consistency(rule: ConsistencyRule, last: float | None, base: Path, where: Path) -> SignalResult:
    summary = check_no_symlinks(base, base / rule.summary, what="summary file")  # no linked directory on the way
    if summary.exists() and not summary.is_file():  # present, but no file: never skipped as missing
        raise IntegrityError(f"consistency rule {rule.name!r} needs {rule.summary}, which is a directory, not a file",
                             where=summary, hint="the summary is the JSON file the run wrote")
    if not summary.is_file():
        if rule.optional:
            return SignalResult(rule.name, "consistency", "SKIP", None, f"{rule.summary} not found (optional)",
                                rule.meaning)
        raise RefusedError(f"consistency rule {rule.name!r} needs {rule.summary}, which is missing",
                           where=summary, hint="pass the run directory that holds it, or mark the rule optional")
    if last is None:
        raise RefusedError(f"consistency rule {rule.name!r} found no row with leaf {rule.leaf}", where=where)
    if os.path.samefile(summary, where):  # the diagnostics themselves (or a hard link): a leaf compared with itself
        raise RefusedError(f"consistency rule {rule.name!r} compares the run's diagnostics with {rule.summary}, which "
                           f"is the same file ({where.name}, a hard link or the path itself): a value compared with "
                           "itself is always consistent and proves nothing", where=summary,
                           hint="name the summary the run wrote beside its diagnostics (e.g. metrics.json)")
    doc = read_json_object(summary)
    ref = get_leaf(doc, parse_path(rule.field))
    if ref is MISSING or isinstance(ref, bool) or not isinstance(ref, int | float):
        raise IntegrityError(f"field {rule.field} is missing or not a number (consistency rule {rule.name!r})",
                             where=summary)
    ref = _float(ref, f"field {rule.field}", summary)
    gap = relative_gap(last, ref, rule.floor)
    compared = f"last {rule.leaf}={last:.10g} vs {rule.summary}:{rule.field}={ref:.10g}"
    if not math.isfinite(gap):  # a NaN or infinite value is never within a bound
        status = "KILL" if rule.thresholds.kill_above is not None else "WARN"
        return SignalResult(rule.name, "consistency", status, gap,
                            f"{compared}: relative gap {gap!r}: non-finite, never within bounds", rule.meaning)
    status, reason = rule.thresholds.grade(gap)
    return SignalResult(rule.name, "consistency", status, gap, f"{compared}: relative gap {gap:.3g} {reason}",
                        rule.meaning)


def relative_gap(a: float, b: float, floor: float) -> float:
    """``|a - b| / max(|a|, |b|, floor)``: 0 when equal, NaN when either is NaN, infinite when either is
    infinite (two equal infinities included: an infinity is no accounting of a quantity)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.nan if math.isnan(a) or math.isnan(b) else math.inf
    if a == b:
        return 0.0
    scale = max(abs(a), abs(b), floor)  # > 0: a and b differ, so one is not 0
    d = abs(a - b)  # overflows only for opposite signs near the float range's end: then scale first
    return abs(a / scale - b / scale) if math.isinf(d) else d / scale


def evaluate(source: str | Path, rules: Rules) -> SignalsReport:
    """Grade ``source`` (a run directory or a diag.jsonl) against ``rules``."""
    diag, base = resolve_source(source)
    found = Path(source).is_dir()  # a diag.jsonl inside a run directory is opened without following a link
    collectors = [_Collector(r) for r in rules.signals]
    con_steps = [parse_path(r.leaf) for r in rules.consistency]
    con_last: list[float | None] = [None] * len(rules.consistency)
    rows = 0
    row_steps = Steps(diag)
    for lineno, row in iter_rows(diag, follow_symlinks=not found):
        step = row_steps.check(row, lineno)
        x = _float(step, f"line {lineno}: step", diag) if step is not None else float(rows)
        rows += 1
        for c in collectors:
            c.add(x, row, lineno, diag)
        for i, (rule, steps) in enumerate(zip(rules.consistency, con_steps, strict=True)):
            v = _number(get_leaf(row, steps), lineno, rule.leaf, rule.name, diag)
            if v is not None:
                con_last[i] = v
    if rows == 0:
        raise IntegrityError("no rows", where=diag, hint="the run wrote no diagnostics")
    short = [f"{c.rule.name!r} needs at least {c.rule.min_rows} {'pairs' if c.rule.reducer == 'pearson' else 'rows'}"
             f" with {c.rule.leaf}, found {c.count()}" for c in collectors if c.count() < c.rule.min_rows]
    if short:
        raise RefusedError("too few rows for signal rule(s): " + "; ".join(short), where=diag,
                           hint="run more steps, or lower the rule's min_rows / pick rules for a short run")
    report = SignalsReport(source=str(diag), rules=rules.source, rows=rows)
    report.results = [_grade_signal(c) for c in collectors]
    report.results += [_grade_consistency(r, v, base, diag) for r, v in zip(rules.consistency, con_last, strict=True)]
    return report
