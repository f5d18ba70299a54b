"""``diag-diff``: stream two JSONL diagnostics files and compare every row leaf by leaf.

Rows are aligned by their integer ``step`` when both files have one, else by position; either way each
file's ``step`` is read by :class:`~replayjob.check.rows.Steps`, as signals reads it (every row has a
number or none has one, and finite steps increase: a restarted run appended to the file is refused); a
row on one side only is a difference.  Files that would read as equal without one leaf compared (every
leaf of every aligned row ignored, or nothing but the ``step`` that aligned them) are refused: equality
over nothing is no evidence.  Leaves compare under :mod:`replayjob.check.leafdiff`'s rules; leaves matched
by the ignore patterns (:data:`~replayjob.check.leaves.DEFAULT_IGNORES` plus ``--ignore``) are skipped.

Speed: a row pair is first compared in C.  The ignored leaves found so far are blanked in both
parsed rows and the two rows are serialised with :mod:`marshal`, an encoding that tags every value
with its type (``true`` and ``1`` encode differently) and floats by their bits.  Equal bytes mean
the rows are equal under any tolerance; any other outcome (a drift, a float within tolerance, a
new ignored leaf, a different key order) takes the exact leafwise path.  Only two rows are held in
memory at a time.

Example:
    >>> report = diff_files("run_a/diag.jsonl", "run_b/diag.jsonl")  # doctest: +SKIP
    >>> report.equal, report.first.step if report.first else None  # doctest: +SKIP
    (False, 2)
"""

from __future__ import annotations

import marshal
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from replayjob.check.diagreport import DiffReport, RowDivergence
from replayjob.check.leafdiff import Tolerance, compare_leaves
from replayjob.check.leaves import DEFAULT_IGNORES, IgnoreSet, Location, flatten
from replayjob.check.rows import Steps, iter_rows
from replayjob.errors import IntegrityError, RefusedError, UsageError

MAX_PLAN = 10_000
FIRST_ROWS = 10


def _blank(row: dict[str, Any], plan: Iterable[Location]) -> None:
    """Set the scalar leaves at ``plan``'s (ignored) locations in ``row`` to ``None`` where they exist.

    Blanking rather than deleting keeps array positions, and both rows of a pair are blanked
    alike, so an ignored leaf can no longer make their bytes differ."""
    for parents, key in plan:
        node: Any = row
        try:
            for step in parents:
                node = node[step]
            if not isinstance(node[key], dict | list):
                node[key] = None
        except (KeyError, IndexError, TypeError):
            continue


def _same_bytes(a: dict[str, Any], b: dict[str, Any]) -> bool:
    try:
        return marshal.dumps(a, 2) == marshal.dumps(b, 2)
    except ValueError:  # nested beyond marshal's depth limit: let the exact path decide
        return False


class _Side:
    """One file being streamed, with its row count and its steps read (:class:`~replayjob.check.rows.Steps`)."""

    def __init__(self, path: str | Path, by_step: bool | None = None, follow_symlinks: bool = True):
        self.path = str(path)
        self.rows: Iterator[tuple[int, dict[str, Any]]] = iter_rows(path, follow_symlinks=follow_symlinks)
        self.steps = Steps(self.path)
        self.count = 0
        self.by_step = by_step
        self.cur: tuple[int, dict[str, Any]] | None = None

    def advance(self) -> None:
        self.cur = next(self.rows, None)
        if self.cur is None:
            return
        self.count += 1
        lineno, row = self.cur
        step = self.steps.check(row, lineno)  # present in every row or none, a number, increasing
        if self.by_step and not isinstance(step, int):
            raise IntegrityError(f"line {lineno}: step {step!r} is not an integer, but the first row's is: rows are "
                                 "aligned by integer steps", where=self.path,
                                 hint="write every step as an integer, or none")

    @property
    def step(self) -> int:
        assert self.cur is not None
        return int(self.cur[1]["step"])


def _has_step(row: dict[str, Any]) -> bool:
    s = row.get("step")
    return isinstance(s, int) and not isinstance(s, bool)


def check_options(tol: Tolerance, ignore: Iterable[str], top: int) -> IgnoreSet:
    """Validate the comparison options (before any expensive work); return the compiled ignores."""
    if top < 0:
        raise UsageError(f"--top must be >= 0, got {top}")
    for name, v in (("--rtol", tol.rtol), ("--atol", tol.atol)):
        if not (v >= 0 and math.isfinite(v)):  # an infinite tolerance would make any two numbers equal
            raise UsageError(f"{name} must be a finite non-negative number, got {v!r}")
    return IgnoreSet(ignore)


def _distinct(path_a: str | Path, path_b: str | Path) -> None:
    """Two names of one file (the same path, a hard link, a symbolic link to it) are refused: a file compared with
    itself reads EQUAL and says nothing about two runs."""
    try:
        sa, sb = os.stat(path_a), os.stat(path_b)
    except OSError:
        return  # both were just opened; a file removed since is read from the open descriptor
    if (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino):
        raise RefusedError(f"{path_a} and {path_b} are one file (the same path, a hard link or a symbolic link to "
                           "it): a file compared with itself is equal and proves nothing",
                           where=f"{path_a} vs {path_b}", hint="compare the diagnostics of two runs")


def diff_files(path_a: str | Path, path_b: str | Path, *, tol: Tolerance | None = None,
               ignore: Iterable[str] = (), top: int = 10, default_ignores: bool = True,
               follow_symlinks: bool = True) -> DiffReport:
    """Compare two JSONL diagnostics files; see the module docstring for the rules.

    ``follow_symlinks=False`` refuses a file that is a symbolic link (files found inside run
    directories rather than named by the user)."""
    tol = tol or Tolerance()
    patterns = (*(DEFAULT_IGNORES if default_ignores else ()), *ignore)
    ig = check_options(tol, patterns, top)
    a, b = _Side(path_a, follow_symlinks=follow_symlinks), _Side(path_b, follow_symlinks=follow_symlinks)
    a.advance()
    b.advance()
    for side in (a, b):
        if side.cur is None:
            raise IntegrityError("no rows", where=side.path, hint="the run wrote no diagnostics")
    assert a.cur is not None and b.cur is not None
    _distinct(a.path, b.path)
    by_step = _has_step(a.cur[1]) and _has_step(b.cur[1])
    a.by_step = b.by_step = by_step
    report = DiffReport(a=a.path, b=b.path, tol=tol, ignore=patterns, top_n=top,
                        aligned_by="step" if by_step else "position")
    plan: set[Location] = set()
    index = 0
    while a.cur is not None or b.cur is not None:
        if a.cur is not None and b.cur is not None and (not by_step or a.step == b.step):
            _compare_pair(report, index, a.cur, b.cur, ig, tol, plan)
            a.advance()
            b.advance()
        elif b.cur is None or (a.cur is not None and a.step < b.step):
            assert a.cur is not None
            _one_side(report, index, "only_in_a", a.cur)
            a.advance()
        else:
            _one_side(report, index, "only_in_b", b.cur)
            b.advance()
        index += 1
    report.rows_a, report.rows_b = a.count, b.count
    if report.equal and not report.leaves_compared:
        raise RefusedError(f"nothing compared: every leaf of the {report.rows_compared} aligned row(s) is ignored "
                           f"or empty{' but the step that aligned them' if by_step else ''}, so the files "
                           "cannot read as equal", where=f"{a.path} vs {b.path}",
                           hint="narrow --ignore (the default ignores are wall-clock times, rates and memory "
                                "peaks) so that some leaf is compared")
    return report


def _compare_pair(report: DiffReport, index: int, ra: tuple[int, dict[str, Any]],
                  rb: tuple[int, dict[str, Any]], ig: IgnoreSet, tol: Tolerance, plan: set[Location]) -> None:
    (line_a, row_a), (line_b, row_b) = ra, rb
    report.rows_compared += 1
    step = row_a.get("step") if report.aligned_by == "step" else None
    if plan:
        _blank(row_a, plan)
        _blank(row_b, plan)
    # Rows aligned by step hold the same step by construction: it is the key that paired them, never a leaf compared.
    key = "step" if report.aligned_by == "step" else None
    if _same_bytes(row_a, row_b):
        if not report.leaves_compared:  # until the first row with a leaf that is compared, not after
            report.leaves_compared = any(path and path != key for path in flatten(row_a, ig))
        report.last_row = RowDivergence(index, step, line_a, line_b, "leaves", 0, [])
        return
    found: set[Location] = set()
    la, lb = flatten(row_a, ig, found), flatten(row_b, ig, found)
    report.leaves_compared = report.leaves_compared or any(path and path != key and path in lb for path in la)
    if len(plan) < MAX_PLAN:
        plan.update(found)
    drifts = compare_leaves(la, lb, tol)
    div = RowDivergence(index, step, line_a, line_b, "leaves", len(drifts), drifts[:report.top_n])
    report.last_row = div
    if drifts:
        _record(report, div)


def _one_side(report: DiffReport, index: int, kind: str, r: tuple[int, dict[str, Any]]) -> None:
    lineno, row = r
    step = row.get("step") if report.aligned_by == "step" else None
    if kind == "only_in_a":
        report.rows_only_in_a += 1
        div = RowDivergence(index, step, lineno, None, kind, 0, [])
    else:
        report.rows_only_in_b += 1
        div = RowDivergence(index, step, None, lineno, kind, 0, [])
    _record(report, div)


def _record(report: DiffReport, div: RowDivergence) -> None:
    if div.kind == "leaves":
        report.rows_diverging += 1
    if report.first is None:
        report.first = div
    if len(report.first_rows) < FIRST_ROWS:
        report.first_rows.append(RowDivergence(div.row, div.step, div.line_a, div.line_b, div.kind,
                                               div.diverging_leaves, []))
